"""The argparse types of the CLI's numbers (luisaml/cli.py): tolerances, seconds, counts, each a
one-line error when the text is not one."""
import argparse


def tolerance(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def seconds(text: str) -> float:
    v = tolerance(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def count(least: int):
    """Return an argparse type: an int of at least `least` (a one-line error otherwise)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"expected a number >= {least}, got {v}")
        return v

    return parse
