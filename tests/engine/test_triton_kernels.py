"""The CUDA attention kernels (issue 45) against ``reference_attention``, on CPU under
``TRITON_INTERPRET=1`` (a subprocess: the variable is read when a kernel is defined) and on a GPU
when there is one: the split-K decode kernel (``triton_paged``) and the varlen extend kernel
(``triton_extend``), over shuffled (non-contiguous) blocks, odd lengths, GQA groups 1, 4 and 8,
windows and soft-capping, float32 and float16. Sizes are tiny: the interpreter runs each program
in numpy."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from inferflow.runtimes.torch_engine.attention import reference_attention
    from inferflow.runtimes.torch_engine.triton_extend import paged_extend_attention
    from inferflow.runtimes.torch_engine.triton_paged import paged_decode_attention

    device = "{device}"
    torch.manual_seed(0)

    def scattered(blocks, bs, hkv, d, dtype):
        k = torch.randn(blocks, bs, hkv, d, device=device).to(dtype)
        v = torch.randn(blocks, bs, hkv, d, device=device).to(dtype)
        return k, v

    def tables_for(lens, bs, blocks):
        # each row its own blocks, shuffled: a row's consecutive positions sit in blocks far apart
        perm = torch.randperm(blocks).tolist()
        width = max(-(-n // bs) for n in lens)
        rows, used = [], 0
        for n in lens:
            need = -(-n // bs)
            rows.append(perm[used:used + need] + [perm[0]] * (width - need))
            used += need
        return torch.tensor(rows, dtype=torch.int32, device=device)

    def compare(out, ref, tol, what):
        err = (out.float() - ref.float()).abs().max().item()
        assert err < tol, (what, err)

    cases = 0
    for dtype, tol in [(torch.float32, 2e-5), (torch.float16, 2e-2)]:
        for hq, hkv in [(2, 2), (4, 1), (8, 1), (8, 2)]:  # GQA groups 1, 4, 8, 4
            bs, d = 4, 16
            for window, softcap in [(0, 0.0), (5, 0.0), (0, 1.5)]:
                # decode: odd lengths, one row of a single position, several splits
                lens = [1, 5, 13, 23]
                k, v = scattered(32, bs, hkv, d, dtype)
                tables = tables_for(lens, bs, 32)
                q = (torch.randn(len(lens), hq, d, device=device) * 2).to(dtype)
                seq = torch.tensor(lens, dtype=torch.int32, device=device)
                starts = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
                ref = reference_attention(q.float(), k.float(), v.float(), tables, seq, starts,
                                          d ** -0.5, window, softcap)
                for splits in (1, 3):
                    out = paged_decode_attention(q, k, v, tables, seq, d ** -0.5, window, softcap,
                                                 num_splits=splits)
                    compare(out, ref, tol, ("decode", dtype, hq, hkv, window, softcap, splits))
                # extend: a chunk after a cached prefix, a whole prompt, decodes, a padding row
                lens, q_lens = [19, 7, 9, 1, 1], [6, 7, 1, 1, 1]
                tables = tables_for(lens, bs, 32)
                n = sum(q_lens)
                q = (torch.randn(n, hq, d, device=device) * 2).to(dtype)
                seq = torch.tensor(lens, dtype=torch.int32, device=device)
                starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()),
                                      dtype=torch.int32, device=device)
                ref = reference_attention(q.float(), k.float(), v.float(), tables, seq, starts,
                                          d ** -0.5, window, softcap)
                for block_m in (2, 0):  # several query tiles per row; the default tile
                    out = paged_extend_attention(q, k, v, tables, seq, starts, d ** -0.5, window,
                                                 softcap, block_m=block_m)
                    compare(out, ref, tol, ("extend", dtype, hq, hkv, window, softcap, block_m))
                cases += 1
    print("ok", cases)
""")


def run_check(device: str, interpret: bool) -> None:
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if interpret else {})}
    result = subprocess.run(
        [sys.executable, "-c", CHECK.format(device=device)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0 and "ok 24" in result.stdout, result.stderr[-4000:]


@pytest.mark.slow  # the Triton interpreter in a subprocess
def test_decode_and_extend_kernels_match_the_reference_in_the_interpreter() -> None:
    run_check("cpu", interpret=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_and_extend_kernels_match_the_reference_on_the_gpu() -> None:
    run_check("cuda", interpret=False)
