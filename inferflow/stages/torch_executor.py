"""``executor=torch``: the torch compiled engine's stage (the engine itself is
``inferflow/runtimes/torch_engine/``, imported only when the stage loads, in the engine worker).

Its settings, its KV budget (the paged block pool: bytes, a size, ``auto``, or on CUDA a fraction
of the GPU) and the one-line errors for settings it would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from inferflow.config.base import ConfigEnum
from inferflow.runtimes.config import TorchSettings
from inferflow.stages.executor import ExecutorStage

if TYPE_CHECKING:
    from inferflow.models.checkpoint import Checkpoint
    from inferflow.models.config import ModelArch
    from inferflow.runtimes.plan_runner import Runner
    from inferflow.scheduling.kv_budget import KVBudget
    from inferflow.scheduling.layout import KVLayout


class TorchDType(ConfigEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class CompileMode(ConfigEnum):
    """``inductor``: ``torch.compile`` (the compiled engine); ``eager``: plain torch (debugging)."""

    inductor = "inductor"
    eager = "eager"


TORCH_INSTALL_HINT = "executor=torch needs torch: pip install 'inferflow[torch]'"
DEFAULT_GPU_FRACTION = 0.9


def parse_fraction(value: str | int | None) -> float | None:
    """``0.9`` (a share of the GPU's memory, vLLM's gpu_memory_utilization) or None."""
    text = str(value).strip()
    if "." not in text:
        return None
    try:
        fraction = float(text)
    except ValueError:
        return None
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_cache_memory: a fraction must be in (0, 1], got {value!r}")
    return fraction


@dataclass
class TorchExecutor(ExecutorStage):
    """The torch compiled engine (``pip install inferflow[torch]``): the Llama family in torch,
    compiled by Inductor (``compile=inductor``; artifacts cached in ``compiled_engines/``), KV in
    a paged block pool read through block tables, on ``device=cpu`` or ``cuda[:N]`` (decode steps
    replayed from CUDA graphs). ``kv_cache_memory`` sizes the pool: bytes, ``"4GiB"``, ``auto``
    (CPU: half of the memory after the weights; CUDA: 0.9 of the GPU) or, on CUDA, a fraction of
    the GPU's memory such as ``0.8`` (weights and what else is in use come out of it)."""

    backend: ClassVar[str] = "torch"
    verifies_drafts: ClassVar[bool] = True  # PlanRunner
    returns_prompt_logprobs: ClassVar[bool] = True  # PlanRunner; the model returns any rows' logits
    serves_lora: ClassVar[bool] = True
    runtime_package: ClassVar[str] = "torch"
    pages_kv: ClassVar[bool] = True
    device: str = "cpu"
    dtype: TorchDType = TorchDType.float32
    compile: CompileMode = CompileMode.inductor
    cuda_graphs: bool = True
    threads: int = 0
    cache_dir: str | None = None
    kv_cache_memory: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        device = str(self.device)
        if not (device == "cpu" or device == "cuda" or
                (device.startswith("cuda:") and device[5:].isdigit())):
            raise ValueError(f"device: must be cpu, cuda or cuda:N, got {device!r}")
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0 (0 = torch's default), got {self.threads}")
        fraction = parse_fraction(self.kv_cache_memory)
        if fraction is not None and not self.on_cuda:
            raise ValueError("kv_cache_memory: a fraction of GPU memory needs device=cuda; on "
                             "CPU give bytes (e.g. 4GiB) or auto")
        if fraction is None:
            from inferflow.scheduling.kv_budget import parse_memory

            parse_memory(self.kv_cache_memory, "kv_cache_memory")

    @property
    def on_cuda(self) -> bool:
        return str(self.device).startswith("cuda")

    @property
    def itemsize(self) -> int:
        return 4 if TorchDType(self.dtype) is TorchDType.float32 else 2

    def check(self, layout: KVLayout) -> None:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise ValueError(f"backend: {TORCH_INSTALL_HINT}")

    def kv_budget(self, arch: ModelArch, model_bytes: int) -> KVBudget | None:
        from inferflow.scheduling.kv_budget import KVBudget, auto_share, kv_bytes_per_token

        per_token = kv_bytes_per_token(arch, self.itemsize)
        if not self.on_cuda:
            return KVBudget.resolve(self.kv_cache_memory, per_token, model_bytes)
        fraction = parse_fraction(self.kv_cache_memory)
        share = auto_share(self.kv_cache_memory)  # auto/N: N engines share the GPU
        if fraction is None and share is None:
            return KVBudget.resolve(self.kv_cache_memory, per_token, model_bytes)
        return self._gpu_budget(fraction or DEFAULT_GPU_FRACTION / (share or 1), arch, per_token)

    def _gpu_budget(self, fraction: float, arch: ModelArch, per_token: int) -> KVBudget:
        """vLLM's rule: ``fraction`` of the GPU's memory, less what is in use and the weights."""
        import torch

        from inferflow.scheduling.kv_budget import KVBudget, human

        if not torch.cuda.is_available():
            raise ValueError(f"executor.device: {self.device}: torch sees no CUDA device "
                             f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
        free, total = torch.cuda.mem_get_info(torch.device(str(self.device)))
        weights = arch.num_parameters * self.itemsize
        room = int(fraction * total) - (total - free) - weights
        if room <= 0:
            raise ValueError(f"executor.kv_cache_memory: {fraction} of {human(total)} leaves no room for "
                             f"KV after {human(total - free)} in use and {human(weights)} of weights")
        return KVBudget(room, per_token, f"executor.kv_cache_memory={fraction} of the GPU's "
                        f"{human(total)}, less {human(total - free)} in use and the weights")

    def create_runner(self, checkpoint: Checkpoint, layout: KVLayout) -> Runner:
        from inferflow.runtimes.torch_engine.runner import TorchRunner

        settings = TorchSettings(device=str(self.device), dtype=TorchDType(self.dtype).value,
                                 compile=CompileMode(self.compile).value,
                                 cuda_graphs=self.cuda_graphs, threads=self.threads,
                                 cache_dir=self.cache_dir)  # (the sizes are the layout's)
        return TorchRunner(checkpoint, settings, layout, **self._runner_lora())

    def weight_scale(self) -> float:
        if self.on_cuda:
            return 0.0  # the weights and the pool live in the GPU's memory
        return 0.5 if TorchDType(self.dtype) is not TorchDType.float32 else 1.0

    @property
    def runtime_version(self) -> str:
        import torch

        return str(torch.__version__)

    def describe(self) -> dict[str, Any]:
        if not self.loaded:
            return super().describe()
        from inferflow.runtimes.torch_engine.runner import TorchRunner  # (loaded: torch is in)

        runner = self.runner
        assert isinstance(runner, TorchRunner)
        return {**super().describe(), "compiled_engine": str(runner.engine_dir.path),
                "runtime_config": runner.describe()}
