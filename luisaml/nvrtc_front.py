"""luisaml's `luisa_nvrtc` front: the program LuisaCompute's CUDA backend runs to compile a kernel
when the device was started in luisaml's tensor-core runtime directory (luisaml/tensor_cores.py).

It speaks the real compiler's protocol (LuisaCompute src/backends/cuda/cuda_compiler.cpp and
cuda_nvrtc_compiler.cpp): the options as arguments; on stdin the file name and then the CUDA source,
each as its size (NUL included) and its bytes; PTX on stdout; `--version` prints the NVRTC version.
The size is 8 raw bytes (a little-endian size_t) in the luisa_nvrtc of the luisa-python 0.3.7 wheel
(its binary has no "Invalid %s size format." message: LuisaCompute before its 2024-04-20 "fix cuda
compiler timeout" commits) and 16 hex digits in later LuisaCompute; the front reads either (8 hex
characters cannot start a raw size under 2^56) and answers in the form it was given. It replaces the body of each marked callable
(shaders/tensor_cores.py) with luisaml's fixed inline-PTX text, checks nothing else, and hands the
source to the real `luisa_nvrtc`:

- a source without a marker goes through byte for byte (the real compiler is exec'd on the same
  bytes), so every other kernel compiles exactly as before;
- a marked callable whose signature is not the one the rule expects is left as written (a note
  on stderr): its FP32 body runs;
- a rewritten source that does not compile is compiled again as written (a note on stderr): the
  FP32 bodies run, and the start-up self-test sees it.

The rules are data luisaml writes into the script (markers, signatures, bodies); nothing here
comes from a model. This file is stdlib only and imports nothing from luisaml: tensor_cores.py
copies its text into the runtime directory's `luisa_nvrtc`, with a header naming the real
compiler and the rules and a last line calling `main`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

_HEAD = "\n__forceinline__ __device__ "
_OPEN = ") noexcept {"
# a callable's parameter as CUDACodegenAST::_emit_variable_decl writes it: `lc_float4 v3`,
# `const lc_array<lc_float, 16> &r7`
_PARAM = re.compile(r"(?:const )?(lc_\w+(?:<[\w ,]+>)?) ?&?([a-z]+[0-9]+)")
_HEADER = re.compile(r"(lc_\w+) (custom_[0-9A-Fa-f]+)\((.*)", re.S)


def rewrite(text: str, rules: list[dict]) -> tuple[str, list[str]]:
    """Return `text` with the body of every callable holding a rule's marker replaced by the rule's
    body (its placeholders named after the callable's parameters), and notes on markers left alone.
    A rule: marker (a decimal literal), returns (the return type), params (the parameter types),
    names (a placeholder per parameter), body (the text between `{` and the closing `}` line)."""
    notes = []
    for rule in rules:
        marker = rule["marker"]
        if marker not in text:
            continue
        token = re.compile(r"(?<![\w.])" + re.escape(marker) + r"(?![\w.])")
        pos = 0
        while True:
            m = token.search(text, pos)
            if m is None:
                break
            pos = m.end()
            start = text.rfind(_HEAD, 0, m.start())
            opened = text.find(_OPEN, start) if start >= 0 else -1
            end = text.find("\n}\n", opened) if opened >= 0 else -1
            if min(start, opened, end) < 0 or not opened < m.start() < end:
                notes.append(f"marker {marker} outside a callable's body: left as written")
                continue
            head = _HEADER.fullmatch(text[start + len(_HEAD):opened])
            params = [_PARAM.fullmatch(p.strip()) for p in head.group(3).split(",\n")] if head else []
            if (head is None or head.group(1) != rule["returns"] or any(p is None for p in params)
                    or [p.group(1) for p in params] != rule["params"]):
                got = text[start + len(_HEAD):opened].replace("\n", " ")
                notes.append(f"marker {marker}: the callable '{got[:160]}' is not "
                             f"{rule['returns']}({', '.join(rule['params'])}): left as written")
                continue
            body = rule["body"]
            for placeholder, p in zip(rule["names"], params):
                body = body.replace(placeholder, p.group(2))
            text = text[:opened + len(_OPEN)] + body + text[end:]
            pos = opened + len(_OPEN) + len(body)
    return text, notes


_HEX = frozenset(b"0123456789abcdefABCDEF")


def frame(data: bytes, hex_size: bool = True) -> bytes:
    """Return one field of the protocol: `data` (its NUL included) after its size, in 16 hex digits
    or (hex_size False) as 8 little-endian bytes."""
    return (b"%016x" % len(data) if hex_size else len(data).to_bytes(8, "little")) + data


def read_frame(stream) -> tuple[bytes, bool]:
    """Read one field of the protocol; return its bytes (NUL included) and whether its size was hex."""
    head = stream.read(8)
    if len(head) != 8:
        raise EOFError("the compiler's input ended before a field's size")
    hex_size = all(c in _HEX for c in head)
    if hex_size:
        rest = stream.read(8)
        if len(rest) != 8 or not all(c in _HEX for c in rest):
            raise EOFError("a field's size is neither 16 hex digits nor 8 bytes")
        size = int(head + rest, 16)
    else:
        size = int.from_bytes(head, "little")
    data = stream.read(size)
    if len(data) != size or not data.endswith(b"\0"):
        raise EOFError("the compiler's input ended inside a field, or a field lacks its NUL")
    return data, hex_size


def _exec_on(real: str, argv: list[str], data: bytes) -> None:
    """Replace this process by the real compiler with `data` as its standard input."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("luisa_nvrtc_input")
    else:  # (not Linux)
        import tempfile

        fd, path = tempfile.mkstemp()
        os.unlink(path)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)
    os.execv(real, [real] + argv[1:])


def main(argv: list[str], real: str, rules: list[dict]) -> int:
    """Run as the `luisa_nvrtc` LuisaCompute starts (argv: its options); return the exit code."""
    if len(argv) == 1 or (len(argv) == 2 and argv[1] in ("--version", "-v")):
        os.execv(real, [real] + argv[1:])
    stdin = sys.stdin.buffer
    name, hex_size = read_frame(stdin)
    source, _ = read_frame(stdin)
    try:
        text = source[:-1].decode("latin-1")
        new, notes = rewrite(text, rules)
    except Exception as e:  # (a bug here must not cost the kernel: it compiles as written)
        new, notes = None, [f"the rewrite failed ({type(e).__name__}: {e}): compiled as written"]
    for note in notes:
        sys.stderr.write(f"luisaml nvrtc front: {note}\n")
    if new is not None and new != text:
        data = frame(name, hex_size) + frame(new.encode("latin-1") + b"\0", hex_size)
        r = subprocess.run([real] + argv[1:], input=data, stdout=subprocess.PIPE)
        if r.returncode == 0 and r.stdout:
            sys.stdout.buffer.write(r.stdout)
            sys.stdout.buffer.flush()
            return 0
        sys.stderr.write(f"luisaml nvrtc front: the kernel with tensor-core bodies did not compile (exit code "
                         f"{r.returncode}); compiling it as written (FP32 bodies)\n")
    sys.stderr.flush()
    _exec_on(real, argv, frame(name, hex_size) + frame(source, hex_size))
    return 1  # (not reached)
