"""The shipped operators, one module per op family; importing this registers them all, except the
fvdb domain's (operators/fvdb), which luisaml.registry imports on the domain's first use."""
from . import activations, elementwise, gemm, shape  # noqa: F401
from . import control  # noqa: E402,F401
from . import constant, indexing, reduce, softmax  # noqa: E402,F401
from . import conv, normalization, pool  # noqa: E402,F401
from . import attention, rnn  # noqa: E402,F401
from . import resize  # noqa: E402,F401
from . import scatter  # noqa: E402,F401
from . import generators  # noqa: E402,F401
from . import topk  # noqa: E402,F401
from . import einsum  # noqa: E402,F401
from . import loss  # noqa: E402,F401
from . import spectral  # noqa: E402,F401
from . import detection  # noqa: E402,F401
