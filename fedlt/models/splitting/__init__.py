"""Cutting a model into a client part and a server part (SPEC §3).

``split(model, at)`` returns ``(client, server)``: two ``nn.Module``s that hold the model's own
modules, parameters and buffers (no copies) under the model's own names, so that

* ``server(client(x)) == model(x)`` in eval mode;
* the parameter names and the buffer names of the two parts are disjoint and together are the
  model's — a part's ``state_dict()`` keys are the model's keys, and BatchNorm running statistics
  live in the part whose layers they normalise;
* optimising or averaging a part changes the model.

``at`` is an index into the model's cut points (``cut_points(model)``; ``2`` or ``"2"``) or a cut
point's name (``"s2"`` for AlexNet, ``"layer2"`` for a timm ResNet). The client part is everything
up to and including the cut point's module, the server part is the rest.

How a model is cut is a *splitter* strategy in ``SPLITTERS``, tried by ascending ``priority``:

* ``own`` (0): the model's own ``split(name)`` / ``split_points()`` (fedlt's AlexNet, s1..s5);
* ``timm_sequential`` (10): timm ResNet, EfficientNet/MobileNetV2, MobileNetV3, ConvNeXt and
  RegNet, whose ``forward_features`` is a chain of modules; the cut points are the model's
  ``feature_info`` entries (stage or block boundaries) and the server finishes with the model's
  ``forward_head``;
* ``timm_vit`` (10): timm ViT-style token models; the cut points are the blocks (their
  ``feature_info``); the client holds the patch embedding, class/register tokens and position
  embedding, so the class token travels inside the activation ``(tokens, dim)``; the server
  holds the remaining blocks, the final norm and ``forward_head`` (pooling, head);
* ``fx`` (100): any other model that ``torch.fx`` can trace: a cut is valid after a module whose
  output is the only value the rest of the graph needs and that leaves parameters on both sides
  with none used on both; for timm models only their ``feature_info`` modules are offered.
  Proxies a trace leaves in module caches (LeViT's ``attention_bias_cache``) are removed, and an
  unexpected exception while building the parts is a ``FedltError`` naming the model and cut.

A plugin registers a splitter object with ``priority``, ``applies(model)``, ``cut_points(model)``
(a list of ``(name, module)``) and ``split(model, index)``.

One module per splitter (``own``, ``timm_sequential``, ``timm_vit``, ``fx`` with its planner
``fx_plan``); ``base`` holds the protocol, the registry and ``SplitPart``, ``api`` the functions above.
"""

from fedlt.models.splitting.api import cut_points, find_splitter, resolve_cut, split, split_points
from fedlt.models.splitting.base import SPLITTERS, SplitPart, SplitPoint, Splitter
from fedlt.models.splitting.fx import FxSplitter
from fedlt.models.splitting.own import OwnSplitter
from fedlt.models.splitting.timm_sequential import TIMM_TRUNKS, TimmSequentialSplitter
from fedlt.models.splitting.timm_vit import TimmViTSplitter

__all__ = ["SPLITTERS", "TIMM_TRUNKS", "FxSplitter", "OwnSplitter", "SplitPart", "SplitPoint", "Splitter",
           "TimmSequentialSplitter", "TimmViTSplitter", "cut_points", "find_splitter", "resolve_cut", "split",
           "split_points"]

# Splitters are stateless strategies: the registry holds one instance of each.
SPLITTERS.add("own", OwnSplitter())
SPLITTERS.add("timm_sequential", TimmSequentialSplitter())
SPLITTERS.add("timm_vit", TimmViTSplitter())
SPLITTERS.add("fx", FxSplitter())
