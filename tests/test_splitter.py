"""``split_graph`` on graphs Dynamo traced: structure, the mutated ``out`` buffer, outputs."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

from pcgspec.compile.custom_ops import split_ops
from pcgspec.compile.forward_context import forward_context
from pcgspec.compile.splitter import split_graph

HEADS, HEAD_DIM = 2, 4


class FakeAttention:
    """Writes a deterministic function of q, k, v and the layer into ``out``."""

    def forward(self, q, k, v, out, layer_id):  # noqa: ANN001, ANN201
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out.copy_(torch.tanh(q * v + k + layer_id))


class ToyDecoder(nn.Module):
    def __init__(self, num_layers: int = 3, use_overload: bool = False) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.embed = nn.Embedding(32, width)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(num_layers))
        self.o = nn.ModuleList(nn.Linear(width, width) for _ in range(num_layers))
        attention = torch.ops.pcgspec.attention
        self.op = attention.default if use_overload else attention

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + positions[:, None]
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(h).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
            out = torch.empty_like(q)
            self.op(q, k, v, out, i)
            h = h + o(out.flatten(1))
        return h


def dynamo_graph(module: nn.Module, *args: torch.Tensor) -> fx.GraphModule:
    graphs: list[fx.GraphModule] = []

    def capture(gm: fx.GraphModule, example_inputs: list[object]):  # noqa: ANN202
        graphs.append(gm)
        return gm.forward

    for t in args:
        torch._dynamo.mark_dynamic(t, 0)
    compiled = torch.compile(module, backend=capture, fullgraph=True, dynamic=False)
    # NOTE: engines built earlier in the session left entries on the same forward's code
    # object; Dynamo's per-code limit (8) counts them too.
    with (
        torch._dynamo.config.patch(recompile_limit=64),
        forward_context(None, FakeAttention()),  # type: ignore[arg-type]
        torch.no_grad(),
    ):
        compiled(*args)
    assert len(graphs) == 1
    return graphs[0]


def inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 32, (num_tokens,)), torch.arange(num_tokens)


@pytest.fixture(scope="module")
def toy() -> tuple[ToyDecoder, fx.GraphModule]:
    torch.manual_seed(0)
    model = ToyDecoder()
    return model, dynamo_graph(model, *inputs(5))


def test_three_split_points_four_compute_pieces_in_order(toy):
    _, gm = toy
    result = split_graph(gm, split_ops())
    assert [p.is_split_op for p in result.pieces] == [False, True] * 3 + [False]
    assert [p.name for p in result.pieces] == [f"submod_{i}" for i in range(7)]
    assert result.num_split_points == 3 and len(result.compute_pieces) == 4
    layer_ids = [
        node.args[4]
        for piece in result.pieces
        if piece.is_split_op
        for node in piece.graph_module.graph.nodes
        if node.op == "call_function"
    ]
    assert layer_ids == [0, 1, 2]


def test_out_buffer_flows_from_compute_piece_through_attention_to_the_next(toy):
    _, gm = toy
    result = split_graph(gm, split_ops())
    calls = list(result.split_module.graph.find_nodes(op="call_module"))
    for i in range(1, len(calls), 2):
        before, attention, after = calls[i - 1], calls[i], calls[i + 1]
        q, out = attention.args[0], attention.args[-1]  # (q, sym size, k, v, out)
        for buffer in (q, out):
            assert buffer.target is operator.getitem and buffer.args[0] is before
        assert out in after.args


def test_split_module_output_equals_original():
    torch.manual_seed(0)
    model = ToyDecoder()
    splits = []

    def split_backend(gm: fx.GraphModule, example_inputs: list[object]) -> fx.GraphModule:
        splits.append(split_graph(gm, split_ops()))
        return splits[-1].split_module

    compiled = torch.compile(model, backend=split_backend, fullgraph=True, dynamic=False)
    for num_tokens in (5, 12, 3):
        ids, pos = inputs(num_tokens)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        with forward_context(None, FakeAttention()), torch.no_grad():  # type: ignore[arg-type]
            torch.testing.assert_close(compiled(ids, pos), model(ids, pos), rtol=0, atol=0)
    assert len(splits) == 1 and splits[0].num_split_points == 3


def test_input_graph_module_is_not_mutated(toy):
    _, gm = toy
    code, nodes = gm.code, [(n.name, n.op, n.target) for n in gm.graph.nodes]
    split_graph(gm, split_ops())
    assert gm.code == code
    assert [(n.name, n.op, n.target) for n in gm.graph.nodes] == nodes


def test_overload_targets_split_too():
    torch.manual_seed(0)
    gm = dynamo_graph(ToyDecoder(num_layers=2, use_overload=True), *inputs(5))
    assert split_graph(gm, split_ops()).num_split_points == 2


def test_no_split_op_gives_one_compute_piece(toy):
    _, gm = toy
    result = split_graph(gm, [torch.ops.aten.mm.default])
    assert [p.is_split_op for p in result.pieces] == [False]


def test_tiny_llama_has_one_split_point_per_layer():
    transformers = pytest.importorskip("transformers")
    from pcgspec.models.llama import LlamaForCausalLM

    num_layers = 3
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    gm = dynamo_graph(model.model, *inputs(6))
    result = split_graph(gm, split_ops())
    assert result.num_split_points == num_layers
    assert len(result.compute_pieces) == num_layers + 1
    assert [p.is_split_op for p in result.pieces] == [False, True] * num_layers + [False]
