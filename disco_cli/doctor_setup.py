"""What ``disco doctor`` finds before it runs a model: the device, the engines it
supports, and (without model arguments) a random-weight pair of the default pair's
architectures written to a folder, so that no download is needed."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from disco.config import ENGINE_DTYPES, ModelConfig
from disco.errors import InvalidRequest
from disco.platform import cpu_flags
from disco_cli.doctor_checks import CheckResult

#: CPU flags worth reporting: what decides the kernels of the engines (docs/engines.md).
REPORTED_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
#: Engines config validation allows on a CPU that the doctor leaves out unless asked for.
#: NOTE: float16 runs on a CPU but without fast kernels here and is none of ``auto``'s
#: candidates (disco.engines.engine_choice.CPU_CANDIDATES); ``--engines float16`` checks it.
CPU_SKIPPED_ENGINES = ("float16",)
#: Seeds of the random-weight models (fixed: every doctor run checks the same weights).
RANDOM_SEEDS = {"target": 0, "draft": 1}
EOS_TOKEN = "<|endoftext|>"


def validate_device(device: str) -> None:
    """Raise :class:`InvalidRequest` for a device string no engine accepts."""
    ModelConfig(dtype="float32", device=device).validate()


def engine_support(device: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(engines the device supports, {refused engine: why})`` as config validation says
    (:meth:`disco.config.ModelConfig.validate`), less :data:`CPU_SKIPPED_ENGINES` on a CPU."""
    supported, refused = [], {}
    for engine in ENGINE_DTYPES:
        try:
            ModelConfig(dtype=engine, device=device).validate()
        except InvalidRequest as error:
            refused[engine] = str(error)
            continue
        if device == "cpu" and engine in CPU_SKIPPED_ENGINES:
            refused[engine] = "not checked by default on a CPU (no fast float16 kernels; not an auto candidate)"
        else:
            supported.append(engine)
    return tuple(supported), refused


def device_check(device: str) -> CheckResult:
    """Whether the device is there, and what it is (name, memory or CPU flags, threads, versions)."""
    import transformers  # noqa: PLC0415

    data = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "cuda_available": torch.cuda.is_available()}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return CheckResult("device", False, f"{device} asked for, but torch finds no CUDA device "
                                                f"(torch {torch.__version__}, CUDA build {torch.version.cuda})",
                               data=data)
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            return CheckResult("device", False, f"{device} asked for, but torch finds "
                                                f"{torch.cuda.device_count()} CUDA device(s)", data=data)
        properties = torch.cuda.get_device_properties(index)
        data.update(device_name=properties.name, capability=f"{properties.major}.{properties.minor}",
                    memory_gib=round(properties.total_memory / 2**30, 1), cuda=torch.version.cuda)
        detail = (f"{properties.name} (compute capability {data['capability']}, {data['memory_gib']} GiB), "
                  f"torch {torch.__version__} CUDA {torch.version.cuda}")
        return CheckResult("device", True, detail, data=data)
    flags = cpu_flags()
    data.update(device_name=_cpu_name(), flags=[flag for flag in REPORTED_CPU_FLAGS if flag in flags],
                machine=platform.machine())
    flags_text = " ".join(data["flags"]) or "none of interest"
    detail = f"{data['device_name']}, {data['threads']} threads, flags {flags_text}, torch {torch.__version__}"
    return CheckResult("device", True, detail, data=data)


def engines_check(device: str, engines: tuple[str, ...]) -> CheckResult:
    """The engines that will be checked, those the device supports, and why the others are refused."""
    supported, refused = engine_support(device)
    detail = f"checking {', '.join(engines)}; " + "; ".join(f"{engine}: {why}" for engine, why in refused.items())
    return CheckResult("engines", True, detail.rstrip("; "),
                       data={"checked": list(engines), "supported": list(supported), "refused": refused})


def write_random_pair(root: Path) -> dict[str, str]:
    """The default pair's architectures (:mod:`disco.models.architectures`) with seeded
    random weights, saved in bfloat16 with a byte-level tokenizer into ``root/target`` and
    ``root/draft``; returns the two folders. Loading them goes through
    :func:`disco.models.loading.load_model` like any model (quantized engines included).

    NOTE: bfloat16 on disk halves the files (3.1 + 1.0 GB); the float32 engine loads the
    same values exactly, so every engine checks the same weights."""
    from disco.models.architectures import default_pair_architectures  # noqa: PLC0415

    tokenizer = byte_tokenizer()
    folders = {}
    for role, architecture in default_pair_architectures().items():
        folder = root / role
        model = architecture.random_model(RANDOM_SEEDS[role], torch.bfloat16, eos_token_id=tokenizer.eos_token_id)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        folders[role] = str(folder)
    return folders


def byte_tokenizer():
    """A byte-level tokenizer with no merges: the 256 byte symbols, then :data:`EOS_TOKEN`
    (built, not trained or downloaded). Ids past its vocabulary (the random models have
    151,936 logits) decode to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab[EOS_TOKEN] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
