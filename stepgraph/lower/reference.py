"""The reference executor: runs a step graph node by node with plain torch ops.

It is the numerical ground truth every provider is checked against. It executes the
frontend's graph and graphs after the shard and pack passes for a world of one (packed
weights, outputs read through column views, collectives that are identities). Each op has
one function in a dispatch table (``ref_dense``, ``ref_kda``, ``ref_mla``); node inputs and
attributes follow ``stepgraph/frontend.py``.

Weights are given by logical graph name (see :mod:`stepgraph.lower.weights`); caches are
the caller's (see :mod:`stepgraph.lower.caches`) and are updated in place; a step's inputs
are the graph's input values (``tokens``, ``kda_state_indices``, ``block_tables``,
``seq_lens``, ``slot_mapping``, ``positions``, ``num_accepted_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage, eval_dim
from stepgraph.ir.values import Value
from stepgraph.lower import ref_dense, ref_kda, ref_mla
from stepgraph.lower.caches import Caches
from stepgraph.lower.ref_common import OpCall, OpFn
from stepgraph.lower.tensors import compute_dtype, read_view, storage_dtype, write_view

REFERENCE_OPS: dict[str, OpFn] = {**ref_dense.OPS, "kda_core": ref_kda.kda_core, **ref_mla.OPS}


class ReferenceExecutor:
    """Executes ``graph`` eagerly: ``step(inputs)`` runs every node in program order and
    returns the graph's outputs (``logits`` [R, vocab] float32).

    ``weights`` maps every weight value of the graph to a tensor of its (per-rank) shape;
    ``caches`` maps every state value to the caller's tensor; ``dtype`` is the compute dtype
    (``float32`` or ``bfloat16``): activation-dtype weights and temps run in it, float32
    values (gates, router, recurrent states, logits) stay float32. ``keep_dtype_above``:
    weights of more elements than this are held as given (every op converts per use), so a
    float32 reference over BF16 weights needs no float32 copy of the large ones (BF16 ->
    float32 is exact). ``ops`` is this executor's own op table (a copy of
    :data:`REFERENCE_OPS`): replacing an entry changes this executor alone.
    """

    def __init__(
        self,
        graph: Graph,
        weights: Mapping[str, torch.Tensor],
        caches: Caches,
        device: torch.device | str = "cpu",
        dtype: str | torch.dtype = "float32",
        keep_dtype_above: int | None = None,
    ) -> None:
        world = int(graph.meta.get("world", 1))
        if world != 1:
            raise UserError(f"the reference executor runs a world of one; this plan is for "
                            f"{world} ranks (compile it with tp=1 dep=1)")
        self.graph = graph
        self.device = torch.device(device)
        self.keep_dtype_above = keep_dtype_above
        # This executor's op table: a caller may replace an op for this executor alone
        # (e.g. a router whose choices are imposed); the module table stays untouched.
        self.ops: dict[str, OpFn] = dict(REFERENCE_OPS)
        self.compute = compute_dtype(dtype) if isinstance(dtype, str) else dtype
        missing_ops = sorted({n.op for n in graph} - set(REFERENCE_OPS))
        if missing_ops:
            raise UserError(f"the reference executor has no implementation of op(s) "
                            f"{', '.join(missing_ops)}")
        self.fixed: dict[str, torch.Tensor] = {}
        for value in graph.values_of(Storage.WEIGHT):
            self.fixed[value.name] = self._bind_weight(value, weights)
        for value in graph.values_of(Storage.STATE):
            if value.name not in caches:
                raise UserError(f"no cache tensor for state {value.name}")
            self.fixed[value.name] = caches[value.name]
        self.last_values: dict[str, torch.Tensor] = {}

    def _bind_weight(self, value: Value, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if value.name not in weights:
            raise UserError(f"weight {value.name} is missing from the weights given")
        tensor = weights[value.name]
        expected = tuple(eval_dim(d, 1) for d in value.type.shape)
        if tuple(tensor.shape) != expected:
            raise UserError(f"weight {value.name}: expected shape {list(expected)}, "
                            f"found {list(tensor.shape)}")
        if self.keep_dtype_above is not None and tensor.numel() > self.keep_dtype_above:
            return tensor.to(self.device)  # ops convert per use: no full-size copy
        return tensor.to(device=self.device, dtype=storage_dtype(value.type.dtype, self.compute))

    # ------------------------------------------------------------------ running

    def step(self, inputs: Mapping[str, torch.Tensor], keep_values: bool = False
             ) -> dict[str, torch.Tensor]:
        """Run one step; ``inputs`` holds every input value of the graph (extra keys are
        ignored). With ``keep_values`` every temp stays readable in ``last_values``."""
        env: dict[str, torch.Tensor] = dict(self.fixed)
        rows = None
        for value in self.graph.values_of(Storage.INPUT):
            if value.name not in inputs:
                raise UserError(f"step input {value.name} is missing")
            tensor = torch.as_tensor(inputs[value.name]).to(self.device)
            env[value.name] = tensor
            if value.type.shape and value.type.shape[0] == "B":
                if rows is not None and tensor.shape[0] != rows:
                    raise UserError(f"step input {value.name} has {tensor.shape[0]} rows, "
                                    f"expected {rows}")
                rows = tensor.shape[0]
        rows = rows or 0
        values = self.graph.values
        for node in self.graph:
            ins = [self._read(env, name) for name in node.inputs]
            out_values = [values[name] for name in node.outputs]
            call = OpCall(
                node=node,
                ins=ins,
                out_types=[v.type for v in out_values],
                out_dtypes=[storage_dtype(v.type.dtype, self.compute) for v in out_values],
                compute=self.compute,
                rows=rows,
            )
            results = self.ops[node.op](call)
            for value, result in zip(out_values, results, strict=True):
                self._write(env, value, result, rows)
        if keep_values:
            self.last_values = env
        return {v.name: self._read(env, v.name) for v in self.graph.values_of(Storage.OUTPUT)}

    def _read(self, env: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        value = self.graph.values[name]
        if value.view is None:
            return env[name]
        return read_view(self._read(env, value.view.base), value.view)

    def _write(self, env: dict[str, torch.Tensor], value: Value, result: torch.Tensor,
               rows: int) -> None:
        if value.view is None:
            env[value.name] = result
            return
        base = self.graph.values[value.view.base]
        if base.name not in env and base.view is None:
            shape = tuple(eval_dim(d, rows) for d in base.type.shape)
            env[base.name] = torch.zeros(shape, dtype=storage_dtype(base.type.dtype, self.compute),
                                         device=self.device)
        target = env[base.name] if base.view is None else self._read(env, base.name)
        write_view(target, value.view, result)
