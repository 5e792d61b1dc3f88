"""Probe (issue 57): activation checkpointing under CUDA graph capture and torch.compile on this GPU.

Prints one line per case: whether capturing a whole training step (forward, backward, optimizer step)
with torch.utils.checkpoint inside works, with and without preserve_rng_state and dropout; and whether
a Hugging Face Llama with the library's checkpointing switch compiles without graph breaks.
Usage: PYTHONPATH=. python bench/probe_checkpoint.py
"""

from __future__ import annotations

import traceback

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, d: int, p: float, preserve: bool, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(4))
        self.preserve, self.reentrant = preserve, reentrant

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant, preserve_rng_state=self.preserve)
        return x.square().mean()


def capture_case(preserve: bool, p: float, reentrant: bool) -> str:
    torch.manual_seed(0)
    net = Net(256, p, preserve, reentrant).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, capturable=True)
    x = torch.randn(64, 256, device="cuda", requires_grad=reentrant)  # reentrant: an input that needs grad

    def step():
        loss = net(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            out = step()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        return f"captured and replayed, loss {float(out.detach()):.4f}"
    except Exception as exc:  # noqa: BLE001
        return f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def hf_case(switch: bool) -> str:
    import time

    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).cuda().train()
    if switch:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(model)
    ids = torch.randint(0, 8000, (8, 512), device="cuda")
    try:
        for _ in range(3):
            compiled(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            compiled(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 100
        breaks = dict(counters["graph_break"])
        return f"transformers {transformers.__version__}: compiled, {ms:.1f} ms/fwd+bwd, graph breaks {sum(breaks.values())} {list(breaks)[:3]}"
    except Exception:  # noqa: BLE001
        return "FAILED: " + traceback.format_exc().splitlines()[-1][:300]


if __name__ == "__main__":
    print("torch", torch.__version__, torch.cuda.get_device_name())
    for preserve in (True, False):
        for p in (0.0, 0.1):
            for reentrant in (False, True):
                print(
                    f"capture preserve_rng_state={preserve} dropout={p} reentrant={reentrant}: {capture_case(preserve, p, reentrant)}",
                    flush=True,
                )
    for switch in (False, True):
        print(f"hf llama compile, checkpointing={switch}: {hf_case(switch)}", flush=True)
