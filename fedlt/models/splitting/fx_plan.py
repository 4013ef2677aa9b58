"""The torch.fx planner behind the ``fx`` splitter: trace a model, find the cuts where one value
crosses and no tensor is used on both sides, and build the two graph modules of a cut."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from fedlt.errors import FedltError, first_line
from fedlt.models.splitting.base import _attach, _complement, _feature_modules


@dataclass
class _FxCut:
    name: str
    module: str
    position: int  # cut after body[position]
    live: Any  # the one fx node the server needs


class _FxPlan:
    """The traced graph of a model and its valid cuts."""

    def __init__(self, model: nn.Module) -> None:
        import torch.fx as fx

        self.model = model
        tracer = _fx_tracer()
        saved = _forget_proxies(model)
        try:
            self.graph = tracer.trace(model)
        except Exception as exc:  # tracing fails on data-dependent control flow etc.
            raise FedltError(
                f"{type(model).__name__} cannot be split: no splitter for its family and torch.fx cannot "
                f"trace it ({_reason(exc)})"
            ) from None
        finally:
            _forget_proxies(model, saved)
        nodes = list(self.graph.nodes)
        for node in nodes:
            foreign = next((arg for arg in node.all_input_nodes if arg.graph is not self.graph), None)
            if foreign is not None:
                raise FedltError(
                    f"{_model_name(model)} cannot be split: its forward reuses a value ({foreign.name!r}) "
                    "that a module kept from an earlier torch.fx trace"
                )
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = next(n for n in nodes if n.op == "output")
        self.body = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
        self.cuts: list[_FxCut] = []
        if len(self.placeholders) != 1:
            return
        self.cuts = self._find_cuts(fx)

    def _attrs(self, node: Any) -> set[str]:
        """Parameter and buffer names a body node reads (through its module or get_attr args)."""
        owned: set[str] = set()
        if node.op == "call_module":
            sub = self.model.get_submodule(node.target)
            owned |= {f"{node.target}.{n}" for n, _ in sub.named_parameters()}
            owned |= {f"{node.target}.{n}" for n, _ in sub.named_buffers()}
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                owned.add(arg.target)
        return owned

    def _find_cuts(self, fx: Any) -> list[_FxCut]:
        body, n = self.body, len(self.body)
        pos = {node: i for i, node in enumerate(body)}
        pos[self.output] = n
        param_names = {name for name, _ in self.model.named_parameters()}
        # Each value is live across cuts [defined, last use); each tensor of the model is "crossed"
        # by cuts [first use, last use): a valid cut has exactly one live value and no crossed tensor.
        live_count = [0] * n
        live_node: list[Any] = [None] * n
        for value in [self.placeholders[0], *body]:
            start = pos.get(value, -1)  # the input is defined before body[0]
            end = max((pos[u] for u in value.users if u in pos), default=start)
            for c in range(max(start, 0), end):
                live_count[c] += 1
                live_node[c] = value
        crossed = [False] * n
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, node in enumerate(body):
            for attr in self._attrs(node):
                first.setdefault(attr, i)
                last[attr] = i
        for attr, i in first.items():
            for c in range(i, last[attr]):
                crossed[c] = True
        first_param = min((i for a, i in first.items() if a in param_names), default=n)
        last_param = max((i for a, i in last.items() if a in param_names), default=-1)

        feature_modules = set(_feature_modules(self.model))
        cuts: list[_FxCut] = []
        seen: dict[str, int] = {}
        for c in range(n - 1):
            if live_count[c] != 1 or live_node[c].op == "placeholder" or crossed[c]:
                continue
            if not first_param <= c < last_param:  # a side without parameters has nothing to train
                continue
            here = list(body[c].meta.get("nn_module_stack", {}))
            after = set(body[c + 1].meta.get("nn_module_stack", {}))
            ending = [m for m in here if m not in after]  # outermost first
            if feature_modules:
                ending = [m for m in ending if m in feature_modules]
            if not ending:
                continue
            module = ending[0]
            seen[module] = seen.get(module, 0) + 1
            name = module if seen[module] == 1 else f"{module}#{seen[module]}"
            cuts.append(_FxCut(name, module, c, live_node[c]))
        return cuts

    def parts(self, cut: _FxCut) -> tuple[nn.Module, nn.Module]:
        import torch.fx as fx

        def copy_into(graph: fx.Graph, env: dict, nodes: Iterable[Any]) -> None:
            def lookup(arg: Any) -> Any:
                if arg not in env and arg.op == "get_attr":
                    env[arg] = graph.node_copy(arg)
                return env[arg]

            for node in nodes:
                env[node] = graph.node_copy(node, lookup)

        client_graph, client_env = fx.Graph(), {}
        client_env[self.placeholders[0]] = client_graph.placeholder(self.placeholders[0].name)
        copy_into(client_graph, client_env, self.body[: cut.position + 1])
        client_graph.output(client_env[cut.live])

        server_graph, server_env = fx.Graph(), {}
        server_env[cut.live] = server_graph.placeholder("activation")
        copy_into(server_graph, server_env, [*self.body[cut.position + 1 :], self.output])

        name = type(self.model).__name__
        client = fx.GraphModule(self.model, client_graph, class_name=f"{name}Client")
        server = fx.GraphModule(self.model, server_graph, class_name=f"{name}Server")
        # Tensors the forward never reads still belong somewhere: the server, so both cover the model.
        used = {n for part in (client, server) for n, _ in [*part.named_parameters(), *part.named_buffers()]}
        for qual in _complement(self.model, used):
            if not _has(server, qual):
                _attach(server, self.model, qual)
        client.training = server.training = self.model.training  # the shared modules keep their modes
        return client, server


def _forget_proxies(model: nn.Module, saved: dict | None = None) -> dict:
    """Keep torch.fx Proxies out of the modules' plain attributes around a trace.

    Tracing runs the model's Python code, so a module that caches a tensor on first use keeps a
    Proxy of that trace instead: timm's LeViT attention (eval mode) stores
    ``attention_biases[:, attention_bias_idxs]`` in its ``attention_bias_cache`` dict, keyed by
    ``str(device)``, which is ``"Proxy(getattr_2)"`` under fx. The next trace would find that key
    and reuse a node of the previous graph. Proxies are dropped from dict attributes, and an
    attribute that now holds a Proxy gets back its value from ``saved`` (the snapshot this
    function returns when called before the trace; dropped if it had none).
    """
    import torch.fx as fx

    snapshot: dict = {}
    for module in model.modules():
        attrs = vars(module)
        before = saved.get(id(module), {}) if saved is not None else {}
        for key, value in list(attrs.items()):
            if isinstance(value, fx.Proxy):
                if key in before and not isinstance(before[key], fx.Proxy):
                    attrs[key] = before[key]
                else:
                    del attrs[key]
            elif isinstance(value, dict):
                for stale in [k for k, v in value.items() if isinstance(v, fx.Proxy)]:
                    del value[stale]
        snapshot[id(module)] = dict(attrs)
    return snapshot


def _model_name(model: nn.Module) -> str:
    """``timm:<name>`` for a timm model (its pretrained config names the architecture), else the class."""
    cfg = getattr(model, "pretrained_cfg", None)
    arch = cfg.get("architecture") if isinstance(cfg, dict) else None
    return f"timm:{arch}" if arch else type(model).__name__


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__


def _has(module: nn.Module, qualname: str) -> bool:
    try:
        module.get_submodule(qualname)
        return True
    except AttributeError:
        pass
    *parents, leaf = qualname.split(".")
    try:
        parent = module.get_submodule(".".join(parents)) if parents else module
    except AttributeError:
        return False
    return leaf in parent._parameters or leaf in parent._buffers


def _fx_tracer() -> Any:
    """torch.fx's tracer, keeping timm's untraceable layers and functions as leaves when timm is loaded."""
    import torch.fx as fx

    leaf_modules: tuple[type, ...] = ()
    functions: tuple[Callable, ...] = ()
    if "timm" in sys.modules:
        from timm.layers import get_notrace_functions, get_notrace_modules

        leaf_modules = tuple(get_notrace_modules())
        functions = tuple(get_notrace_functions())

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, leaf_modules) or super().is_leaf_module(m, qualname)

    return Tracer(autowrap_functions=functions)
