"""The shipped operators, one module per op family; importing this registers them all into
luisaml.registry (the compiler imports it), except the fvdb domain's (operators/fvdb), which
register on the domain's first lookup."""
if __name__ != "luisaml.operators":
    # the checkout's operators/ imported as a top-level package (its root on sys.path, as under
    # `python -m pytest`): a second copy of every class, registered over luisaml's
    raise ImportError(f"operators/ is the package luisaml.operators: import that, not {__name__!r} (a second "
                      "copy would register its own operator classes in place of luisaml's)")

from luisaml import registry  # noqa: E402

from . import activations, elementwise, gemm, shape  # noqa: F401
from . import control  # noqa: E402,F401
from . import constant, indexing, reduce, softmax  # noqa: E402,F401
from . import col2im, conv, conv_transpose, normalization, pool  # noqa: E402,F401
from . import attention, rnn  # noqa: E402,F401
from . import resize  # noqa: E402,F401
from . import scatter  # noqa: E402,F401
from . import generators  # noqa: E402,F401
from . import topk  # noqa: E402,F401
from . import einsum  # noqa: E402,F401
from . import loss  # noqa: E402,F401
from . import spectral  # noqa: E402,F401
from . import detection  # noqa: E402,F401


def _load_fvdb() -> None:
    from . import fvdb  # noqa: F401


registry.load_on_first_use("fvdb", _load_fvdb)
