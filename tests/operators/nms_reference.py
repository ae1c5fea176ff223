"""numpy references of the luisaml domain's NMS ops, written from the published definitions, not from
the kernels: OpenPCDet's `boxes_iou_bev` / `nms_gpu` (pcdet/ops/iou3d_nms: box_overlap gathers the
edge crossings of the two rotated rectangles and the corners of each inside the other, sorts them by
angle about their mean and takes the shoelace area; iou = overlap / max(area_a + area_b - overlap,
1e-8); greedy suppression in descending score order, IoU > threshold) and CenterPoint's `circle_nms`
(det3d/core/utils/circle_nms_jit.py: greedy in descending score order, dropping a box whose squared
centre distance to a kept one is <= min_radius**2).

Where these choose: equal scores keep the lower index first (a stable sort; OpenPCDet's torch sort
and CenterPoint's argsort leave it unspecified); OpenPCDet's corner-inside test widens each box by
a MARGIN of 1e-2 to catch corners on the other box's edge under float error, which also counts
corners up to 1e-2 outside: `margin` is a parameter here, and the tests use 1e-4 (the luisaml kernel
clips exactly, boundary included)."""
from __future__ import annotations

import numpy as np

OPENPCDET_MARGIN = 1e-2


def bev_corners(box) -> np.ndarray:
    """Return the 4 corners [4, 2] of a BEV box (x, y, dx, dy, heading), rotated counter-clockwise
    about its centre (OpenPCDet's rotate_around_center)."""
    x, y, dx, dy, h = (float(v) for v in box)
    c, s = np.cos(h), np.sin(h)
    local = np.array([[-dx / 2, -dy / 2], [dx / 2, -dy / 2], [dx / 2, dy / 2], [-dx / 2, dy / 2]])
    return np.stack([local[:, 0] * c - local[:, 1] * s + x, local[:, 0] * s + local[:, 1] * c + y], 1)


def _inside(box, p, margin: float) -> bool:
    """OpenPCDet's check_in_box2d: p rotated into the box's frame, |u| < dx/2 + margin and |v| < dy/2 + margin."""
    x, y, dx, dy, h = (float(v) for v in box)
    c, s = np.cos(-h), np.sin(-h)
    u = (p[0] - x) * c - (p[1] - y) * s
    v = (p[0] - x) * s + (p[1] - y) * c
    return abs(u) < dx / 2 + margin and abs(v) < dy / 2 + margin


def _cross(a, b, c) -> float:
    """(a - c) x (b - c), OpenPCDet's cross(p1, p2, p0)."""
    return (a[0] - c[0]) * (b[1] - c[1]) - (b[0] - c[0]) * (a[1] - c[1])


def _crossing(p0, p1, q0, q1):
    """The crossing point of segments p0p1 and q0q1 when they cross properly (OpenPCDet's
    intersection(): both straddle tests strictly positive), else None."""
    s1, s2 = _cross(q0, p1, p0), _cross(p1, q1, p0)
    s3, s4 = _cross(p0, q1, q0), _cross(q1, p1, q0)
    if not (s1 * s2 > 0 and s3 * s4 > 0):
        return None
    d = np.asarray(p1) - p0
    e = np.asarray(q1) - q0
    den = d[0] * e[1] - d[1] * e[0]
    t = ((q0[0] - p0[0]) * e[1] - (q0[1] - p0[1]) * e[0]) / den
    return np.asarray(p0) + t * d


def box_overlap(a, b, margin: float = OPENPCDET_MARGIN) -> float:
    """OpenPCDet's box_overlap: the area of the intersection of BEV boxes a and b."""
    ca, cb = bev_corners(a), bev_corners(b)
    pts = []
    for i in range(4):
        for j in range(4):
            p = _crossing(ca[i], ca[(i + 1) % 4], cb[j], cb[(j + 1) % 4])
            if p is not None:
                pts.append(p)
    pts += [p for p in ca if _inside(b, p, margin)]
    pts += [p for p in cb if _inside(a, p, margin)]
    if len(pts) < 3:
        return 0.0
    pts = np.array(pts)
    centre = pts.mean(0)
    pts = pts[np.argsort(np.arctan2(pts[:, 1] - centre[1], pts[:, 0] - centre[0]), kind="stable")]
    x, y = pts[:, 0], pts[:, 1]
    return abs(float(np.sum(x * np.roll(y, -1) - np.roll(x, -1) * y))) / 2


def iou_bev(a, b, margin: float = OPENPCDET_MARGIN) -> float:
    """OpenPCDet's iou_bev: overlap / max(area_a + area_b - overlap, 1e-8)."""
    overlap = box_overlap(a, b, margin)
    return overlap / max(float(a[2]) * float(a[3]) + float(b[2]) * float(b[3]) - overlap, 1e-8)


def to_bev(boxes: np.ndarray) -> np.ndarray:
    """[N, 5] (x, y, dx, dy, heading) as they are, or [N, 7] (x, y, z, dx, dy, dz, heading) to [N, 5]."""
    boxes = np.asarray(boxes, np.float64)
    return boxes if boxes.shape[1] == 5 else boxes[:, [0, 1, 3, 4, 6]]


def rotated_nms(boxes, scores, iou_threshold: float, max_output: int = -1, margin: float = OPENPCDET_MARGIN):
    """OpenPCDet's nms_gpu (then post_max_size): kept indices in descending score order."""
    bev = to_bev(boxes)
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    removed = np.zeros(len(order), bool)
    keep = []
    for a, i in enumerate(order):
        if removed[a]:
            continue
        keep.append(int(i))
        for b in range(a + 1, len(order)):
            if not removed[b] and iou_bev(bev[i], bev[order[b]], margin) > iou_threshold:
                removed[b] = True
    return np.array(keep if max_output < 0 else keep[:max_output], np.int64)


def circle_nms(centers, scores, min_radius: float, max_output: int = -1):
    """CenterPoint's circle_nms(dets, thresh=min_radius**2), then [:post_max_size]; float32 distances."""
    centers = np.asarray(centers, np.float32)
    thresh = np.float32(float(min_radius) ** 2)
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    suppressed = np.zeros(len(order), bool)
    keep = []
    for a, i in enumerate(order):
        if suppressed[i]:
            continue
        keep.append(int(i))
        for b in range(a + 1, len(order)):
            j = order[b]
            if suppressed[j]:
                continue
            dist = (centers[i, 0] - centers[j, 0]) ** 2 + (centers[i, 1] - centers[j, 1]) ** 2
            if dist <= thresh:
                suppressed[j] = True
    return np.array(keep if max_output < 0 else keep[:max_output], np.int64)
