"""Train the embedded default model, ``tiny_llama``, on the Python documentation's reST sources.

    apt-get install python3.11-doc        # the corpus: PSF licence, ~12 MB of .rst.txt
    pip install torch==2.13.0 transformers
    python scripts/train_tiny_llama.py --minutes 18   # on 2 cores; writes inferflow/models/tiny_llama/

Not run in CI. CPU training is not bit-identical across machines or thread counts, so a rerun
reproduces the committed weights within a tolerance (held-out perplexity within a few percent),
not byte for byte. What it does:

1. the corpus: every ``*.rst.txt`` under ``--corpus`` (sorted); a file whose name hashes to 0 mod
   20 is held out (5 %), the rest is trained on;
2. a byte-level BPE tokenizer of ``--vocab`` tokens trained on the training files, with the chat
   special tokens of the generated test checkpoints (``inferflow.models.tiny``);
3. a Llama (``--hidden``, ``--layers``, ``--heads``/``--kv-heads``, ``--mlp``) trained with
   transformers' ``LlamaForCausalLM`` in fp32 (``--bf16`` autocast where the CPU has bf16
   instructions): AdamW, linear warm-up then cosine decay over the wall-time budget, random
   windows of ``--seq`` tokens, for ``--minutes``;
4. held-out perplexity and top-1 accuracy in fp32; the weights written as fp16 safetensors in
   Hugging Face layout, with ``heldout.txt`` (a slice of held-out text for the quality tests) and
   ``training.json`` (the settings and the figures).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.models.safetensors_writer import save_safetensors  # noqa: E402
from inferflow.models.tiny import TinySpec, config_json, train_tokenizer  # noqa: E402

OUT = REPO / "inferflow" / "models" / "tiny_llama"
HELDOUT_CHARS = 24_000  # held-out text shipped for the quality tests


def corpus(root: Path) -> tuple[list[str], list[str]]:
    train, heldout = [], []
    for path in sorted(root.rglob("*.rst.txt")):
        text = path.read_text(errors="replace")
        bucket = int(hashlib.sha1(str(path.relative_to(root)).encode()).hexdigest(), 16) % 20
        (heldout if bucket == 0 else train).append(text)
    return train, heldout


def encode(tokenizer_path: Path, docs: list[str]) -> np.ndarray:
    """Documents as one id stream, each opened with <|begin_of_text|> and closed with
    <|end_of_text|> (ids 0 and 1)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    ids: list[int] = []
    # (without the post-processor's BOS: the stream places 0 and 1 itself)
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += [0, *enc.ids, 1]
    return np.array(ids, dtype=np.int64)


def evaluate(model, ids: np.ndarray, seq: int, max_windows: int = 256) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Held-out perplexity and top-1 accuracy over consecutive windows (fp32)."""
    import torch

    n = min((len(ids) - 1) // seq, max_windows)
    nll, correct, count = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, n, 16):
            batch = [ids[i * seq:(i + 1) * seq + 1] for i in range(start, min(start + 16, n))]
            x = torch.from_numpy(np.stack([b[:-1] for b in batch]))
            y = torch.from_numpy(np.stack([b[1:] for b in batch]))
            logits = model(input_ids=x).logits.float()
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                     reduction="sum").item()
            correct += int((logits.argmax(-1) == y).sum())
            count += y.numel()
    model.train()
    return math.exp(nll / count), correct / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("/usr/share/doc/python3.11/html/_sources"))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=768)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast (fast only where the CPU has bf16 instructions: measured "
                        "40x slower than fp32 on a 2-core AVX2 EPYC)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    train_docs, heldout_docs = corpus(args.corpus)
    if not train_docs or not heldout_docs:
        raise SystemExit(f"no *.rst.txt under {args.corpus} (apt-get install python3.11-doc)")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(args.vocab, out, texts=train_docs)
    train_ids, heldout_ids = encode(out / "tokenizer.json", train_docs), encode(out / "tokenizer.json", heldout_docs)
    print(f"corpus: {len(train_docs)} training files, {len(train_ids):,} tokens; "
          f"{len(heldout_docs)} held out, {len(heldout_ids):,} tokens", flush=True)

    spec = TinySpec(hidden_size=args.hidden, intermediate_size=args.mlp, num_layers=args.layers,
                    num_heads=args.heads, num_kv_heads=args.kv_heads, vocab_size=args.vocab,
                    max_position_embeddings=2048, rope_theta=10000.0, llama3_rope_scaling=False)
    cfg_json = config_json(spec, args.hidden // args.heads, "float16")
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg_json))
    model.train()
    params = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    budget_s, warmup = args.minutes * 60, 100
    started, step, tokens, losses = time.perf_counter(), 0, 0, []
    while (elapsed := time.perf_counter() - started) < budget_s:
        progress = elapsed / budget_s  # the schedule follows wall time: the budget is minutes
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train_ids) - args.seq - 1, size=args.batch)
        window = torch.from_numpy(np.stack([train_ids[s:s + args.seq + 1] for s in starts]))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab),
                                                 window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, tokens = step + 1, tokens + args.batch * args.seq
        losses.append(loss.item())
        if step % 100 == 0:
            print(f"step {step}: loss {np.mean(losses[-100:]):.3f}, lr {lr:.2e}, "
                  f"{tokens / (time.perf_counter() - started):,.0f} tokens/s", flush=True)
    train_s = time.perf_counter() - started
    model = model.float()
    ppl, top1 = evaluate(model, heldout_ids, args.seq)
    print(f"held-out perplexity {ppl:.2f}, top-1 accuracy {top1:.1%}", flush=True)

    weights = {name: t.detach().float().numpy() for name, t in model.state_dict().items()
               if not name.endswith("rotary_emb.inv_freq")}
    save_safetensors(weights, out / "model.safetensors", "float16")
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 4, "do_sample": False}, indent=2) + "\n")
    (out / "heldout.txt").write_text("\n\n".join(heldout_docs)[:HELDOUT_CHARS])
    (out / "training.json").write_text(json.dumps({
        "corpus": "Python 3.11 documentation, reST sources (Debian python3.11-doc), PSF License",
        "train_files": len(train_docs), "train_tokens": len(train_ids),
        "heldout_files": len(heldout_docs), "heldout_tokens": len(heldout_ids),
        "parameters": params, "steps": step, "tokens_seen": tokens, "train_seconds": round(train_s, 1),
        "heldout_perplexity": round(ppl, 3), "heldout_top1": round(top1, 4),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
    }, indent=2) + "\n")
    print(f"wrote {out}: {params:,} parameters, {step} steps, {tokens:,} tokens in {train_s:.0f} s")


if __name__ == "__main__":
    main()
