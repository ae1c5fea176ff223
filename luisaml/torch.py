"""luisaml.torch.compile: a torch.nn.Module exported through torch.onnx.export (the dynamo exporter,
TorchScript's where that fails), compiled by luisaml, and handed back as a torch.nn.Module whose
forward runs the compiled network; torch.compile's backend "luisaml" (dynamo_backend).

`import torch` below is the real torch: imports are absolute, so this module's own name does
not shadow it."""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from typing import Any, Mapping, Sequence

import torch

from .errors import UsageError
from .log import logger
from .network import CompiledNetwork

BATCH = "batch"  # the symbol of the batch dimension given to every input's dim 0


class CompiledModule(torch.nn.Module):
    """A compiled network as a torch.nn.Module: forward(*inputs, **named_inputs) runs it and returns
    torch tensors on the inputs' device, one tensor or a tuple as the original module did.

    torch CUDA tensors on luisaml's CUDA backend are shared with the kernels through DLPack (no
    copies); anything else goes through the host. Inference only: outputs carry no autograd graph,
    and the weights are those of the module when it was compiled."""

    def __init__(self, net: CompiledNetwork, input_names: list[str], output_names: list[str], single: bool):
        super().__init__()
        self.net = net
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self._single = single
        self.exporter = "torchscript"  # which of torch.onnx.export's exporters made the graph (compile sets it)

    def forward(self, *inputs: Any, **named_inputs: Any):
        """Return the compiled network's outputs for these inputs (positional in the order of the
        module's forward, or by name)."""
        if len(inputs) > len(self.input_names):
            raise UsageError(f"forward takes {len(self.input_names)} input{'' if len(self.input_names) == 1 else 's'} "
                             f"({', '.join(self.input_names)}), "
                             f"got {len(inputs)}")
        feeds = dict(zip(self.input_names, inputs))
        twice = sorted(set(feeds) & set(named_inputs))
        if twice:
            raise UsageError(f"input(s) {twice} given both by position and by name")
        feeds.update(named_inputs)
        # the exporter drops an input the graph never reads; the module ignored it too
        used = {s.name for s in self.net.inputs}
        feeds = {k: (v if isinstance(v, torch.Tensor) else torch.as_tensor(v)) for k, v in feeds.items()
                 if k in used or k not in self.input_names}
        device = next((v.device for v in feeds.values()), torch.device("cpu"))
        results = self.net.run(feeds, self.output_names)
        out = tuple(_on(results[n], device) for n in self.output_names)
        return out[0] if self._single else out

    def extra_repr(self) -> str:
        """Return what repr() shows inside the parentheses: inputs, outputs, backend, stages."""
        return (f"inputs={self.input_names}, outputs={self.output_names}, backend={self.net.backend!r}, "
                f"stages={len(self.net.plan.schedule.stages) if self.net.plan.schedule is not None else 0}")


def _on(value, device: torch.device) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
    return t if t.device == device else t.to(device)


def _input_names(module: torch.nn.Module, n: int) -> list[str]:
    """Return the names of the first n parameters of module.forward (input_k where it has none)."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"input_{k}" for k in range(len(names), n)]


EXPORTERS = ("auto", "dynamo", "torchscript")
# torch's own loggers that the dynamo exporter talks through (which optional packages it skips, what it
# decomposes): notes for torch's developers, not for the caller of compile
_EXPORT_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "torch._export", "onnxscript")


@contextlib.contextmanager
def _quiet_export():
    """Silence, while a module is exported, torch's deprecation and future notices and its loggers'
    chatter below ERROR: they speak of torch's internals, which the caller did not call."""
    loggers = [logging.getLogger(n) for n in _EXPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        # the dynamo exporter's note that two inputs sharing the batch Dim share its name too
        warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used", category=UserWarning)
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def _dynamic_shapes(args: tuple, ins: list[str], dynamic_axes: Mapping[str, Any]) -> tuple:
    """Return torch.export's dynamic_shapes for the inputs from dynamic_axes ({input: {axis: symbol}}
    or {input: [axis, ...]}); one torch.export.Dim per symbol, so that equal symbols stay equal.
    Outputs need none: the exporter derives their dimensions."""
    dims: dict[str, Any] = {}
    shapes = []
    for name in ins[:len(args)]:
        axes = dynamic_axes.get(name)
        if not axes:
            shapes.append(None)
            continue
        named = dict(axes) if isinstance(axes, Mapping) else {int(a): f"{name}_dim{a}" for a in axes}
        shapes.append({int(a): dims.setdefault(str(sym), torch.export.Dim(_dim_name(str(sym))))
                       for a, sym in named.items()})
    return tuple(shapes)


def _dim_name(symbol: str) -> str:
    """Return a symbol as torch.export.Dim accepts it (a Python identifier)."""
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in symbol)
    return name if name.isidentifier() else f"d_{name}"


def _export_dynamo(module, args, ins, names_out, dynamic_axes, extra) -> bytes:
    """Return the ONNX bytes of torch.onnx.export(dynamo=True) (torch.export's graph)."""
    program = torch.onnx.export(module, args, None, dynamo=True, input_names=ins, output_names=names_out,
                                dynamic_shapes=_dynamic_shapes(args, ins, dynamic_axes), verbose=False, **extra)
    return program.model_proto.SerializeToString()


def _export_torchscript(module, args, ins, names_out, dynamic_axes, extra) -> bytes:
    """Return the ONNX bytes of torch.onnx.export(dynamo=False) (TorchScript's trace)."""
    buf = io.BytesIO()
    torch.onnx.export(module, args, buf, dynamo=False, input_names=ins, output_names=names_out,
                      dynamic_axes=dict(dynamic_axes), **extra)
    return buf.getvalue()


def compile(module: torch.nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor], *,
            dynamic_axes: Mapping[str, Any] | None = None, input_names: Sequence[str] | None = None,
            output_names: Sequence[str] | None = None, opset_version: int | None = None,
            exporter: str = "auto", **options: Any) -> CompiledModule:
    """Return `module` compiled by luisaml, as a torch.nn.Module that runs the compiled network.

    example_inputs: a tensor or a tuple of tensors the module's forward takes (traced once).
    dynamic_axes: torch.onnx.export's argument; default: dim 0 of every input, and of every output
    whose dim 0 is the inputs' batch size, is the symbolic batch dimension "batch" (pass {} for
    fixed shapes). input_names: default, the names of forward's parameters; output_names:
    default "output" (one output) or "output_0", "output_1", ...; opset_version: the exporter's
    (None: its default). exporter: "auto" (torch.onnx.export's dynamo exporter, and where it
    fails to export the module or luisaml refuses its graph, the TorchScript exporter), "dynamo"
    or "torchscript" (that one only); the compiled module's `exporter` says which made it. The
    other options are luisaml.compile's (backend, precision, ...).

    The module is exported in eval mode; torch's deprecation notices and exporter logs are kept
    from the caller."""
    from . import runtime

    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"luisaml.torch.compile takes a torch.nn.Module, got {type(module).__name__}")
    if exporter not in EXPORTERS:
        raise UsageError(f"exporter must be one of {', '.join(EXPORTERS)}, not {exporter!r}")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise UsageError("example_inputs must be a tensor or a tuple of tensors, got "
                         f"{[type(a).__name__ for a in args]}")
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            example_out = module(*args)
        single = isinstance(example_out, torch.Tensor)
        outs = (example_out,) if single else example_out
        if not isinstance(outs, (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in outs):
            raise UsageError(f"the module must return a tensor or a tuple of tensors, got {type(example_out).__name__}")
        ins = list(input_names) if input_names is not None else _input_names(module, len(args))
        if output_names is not None:
            names_out = list(output_names)
        else:
            names_out = ["output"] if single else [f"output_{k}" for k in range(len(outs))]
        if dynamic_axes is None:
            batch = args[0].shape[0] if args and args[0].dim() else None
            dynamic_axes = {n: {0: BATCH} for n, a in zip(ins, args) if a.dim()}
            dynamic_axes.update({n: {0: BATCH} for n, o in zip(names_out, outs) if o.dim() and o.shape[0] == batch})
        extra = {} if opset_version is None else {"opset_version": opset_version}
        export = (module, args, ins, names_out, dynamic_axes, extra)
        net, used = None, exporter
        if exporter in ("auto", "dynamo"):
            try:
                with _quiet_export():
                    raw = _export_dynamo(*export)
                net = _compiled(raw, module, runtime, options)
                used = "dynamo"
            except Exception as e:  # (any: torch.export's failures have no common base class)
                # torch.export refuses what it cannot trace soundly (data-dependent branches, some
                # Python), and luisaml may refuse an op the dynamo exporter's decompositions made;
                # the TorchScript trace may still give a graph luisaml compiles
                if exporter == "dynamo":
                    raise
                logger.info("luisaml.torch.compile: the dynamo exporter failed (%s: %s); exporting with TorchScript",
                            type(e).__name__, " ".join(str(e).split())[:300])
        if net is None:
            with _quiet_export():
                raw = _export_torchscript(*export)
            net = _compiled(raw, module, runtime, options)
            used = "torchscript"
    finally:
        module.train(was_training)
    compiled = CompiledModule(net, ins, names_out, single)
    compiled.exporter = used
    return compiled


def _compiled(raw: bytes, module: torch.nn.Module, runtime, options: Mapping[str, Any]) -> CompiledNetwork:
    """Return the network luisaml compiles from an exported module's ONNX bytes."""
    import onnx

    proto = onnx.load_from_string(raw)
    proto.graph.name = type(module).__name__  # names the generated module's file and header
    return runtime.compile(proto, **options)


def dynamo_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any):
    """torch.compile's backend "luisaml" (`torch.compile(model, backend="luisaml")`): dynamo hands
    over each FX subgraph between graph breaks (the breaks run eagerly, as dynamo runs them) with
    its example inputs; the subgraph is exported to ONNX with its shapes fixed (dynamo compiles a
    new subgraph for new shapes) and compiled by luisaml. A subgraph luisaml cannot compile runs
    eagerly, after one warning naming why."""
    try:
        compiled = compile(gm, tuple(example_inputs), dynamic_axes={}, **options)
    except Exception as e:  # an operator, dtype or input (a SymInt) luisaml does not take
        why = " ".join(str(e).split())
        warnings.warn(f"luisaml cannot compile this torch.compile subgraph ({len(gm.graph.nodes)} FX nodes), which runs "
                      f"eagerly: {type(e).__name__}: {why[:300]}", UserWarning, stacklevel=2)
        return gm.forward
    return compiled


def _register_dynamo_backend() -> None:
    """Register dynamo_backend as "luisaml" in this process (the package's torch_dynamo_backends
    entry point does the same for an installed luisaml, without an import)."""
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend
    except ImportError:  # a torch without dynamo
        return
    if _BACKENDS.get("luisaml") is None:
        register_backend(compiler_fn=dynamo_backend, name="luisaml")


_register_dynamo_backend()
