"""The case families: each module registers its recipes and lists its cases (`cases()`).

A family is one row of the summary table and one kind of hostile input. FAMILIES maps the row name
to its module; the catalog (catalog.py) asks each for its cases.
"""
from __future__ import annotations

from . import (
    cache,
    cli,
    concurrency,
    feeds,
    graphs,
    json_models,
    limits,
    names,
    nan,
    nvdb,
    protobuf,
    weights,
)

FAMILIES = {
    "names": names,
    "graphs": graphs,
    "limits": limits,
    "protobuf": protobuf,
    "weights": weights,
    "json": json_models,
    "feeds": feeds,
    "nan": nan,
    "nvdb": nvdb,
    "cache": cache,
    "cli": cli,
    "concurrency": concurrency,
}
