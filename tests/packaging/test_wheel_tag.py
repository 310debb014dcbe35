"""tools/check_wheel.py, which `nox -s build` runs on the wheel it makes, on synthetic wheels:
it passes a manylinux_2_28 wheel whose module needs glibc 2.28 at most and fails every other
kind, so a wheel that pip would refuse on RHEL 8 or Ubuntu 20.04 fails the build."""

from __future__ import annotations

import importlib.util
import struct
import sys
import zipfile
from pathlib import Path

import pytest

CHECKER = Path(__file__).resolve().parents[2] / "tools" / "check_wheel.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_wheel", CHECKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_wheel"] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["check_wheel"]


def synthetic_elf(libraries: list[str], versions: dict[str, list[str]]) -> bytes:
    """A 64-bit little-endian ELF with only the sections the checker reads: a string table,
    .dynamic with DT_NEEDED entries and .gnu.version_r naming `versions` per library."""
    strings = bytearray(b"\0")

    def add(text: str) -> int:
        strings.extend(text.encode() + b"\0")
        return len(strings) - len(text) - 1

    dynamic = b"".join(struct.pack("<qQ", 1, add(lib)) for lib in libraries)
    dynamic += struct.pack("<qQ", 0, 0)
    verneed = bytearray()
    for index, (library, names) in enumerate(versions.items()):
        last = index == len(versions) - 1
        next_need = 0 if last else 16 + 16 * len(names)
        verneed += struct.pack("<HHIII", 1, len(names), add(library), 16, next_need)
        for position, name in enumerate(names):
            next_aux = 0 if position == len(names) - 1 else 16
            verneed += struct.pack("<IHHII", 0, 0, 2 + position, add(name), next_aux)

    header_size = 64
    body = bytes(strings) + dynamic + bytes(verneed)
    string_offset = header_size
    dynamic_offset = string_offset + len(strings)
    verneed_offset = dynamic_offset + len(dynamic)
    section_offset = header_size + len(body)
    sections = [
        (0, 0, 0, 0, 0),  # the null section
        (3, string_offset, len(strings), 0, 0),  # SHT_STRTAB
        (6, dynamic_offset, len(dynamic), 1, 0),  # SHT_DYNAMIC, strings in section 1
        (0x6FFFFFFE, verneed_offset, len(verneed), 1, len(versions)),  # SHT_GNU_verneed
    ]
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, section_offset, 0, 64, 0, 0, 64, len(sections), 0
    )
    table = b"".join(
        struct.pack("<IIQQQQIIQQ", 0, kind, 0, 0, offset, size, link, info, 1, 0)
        for kind, offset, size, link, info in sections
    )
    return header + body + table


GOOD_SO = {
    "libraries": ["libdl.so.2", "libgcc_s.so.1", "libc.so.6"],
    "versions": {
        "libgcc_s.so.1": ["GCC_3.0", "GCC_4.2.0"],
        "libc.so.6": ["GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.28"],
    },
}


def make_wheel(
    tmp_path: Path, tags: list[str], so: dict | None = None, name: str = "_native.abi3.so"
) -> Path:
    path = tmp_path / "batchinv-0.1.0-cp311-abi3-whatever.whl"
    wheel_text = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
    wheel_text += "".join(f"Tag: cp311-abi3-{tag}\n" for tag in tags)
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("batchinv/__init__.py", "")
        if so is not None:
            wheel.writestr(f"batchinv/{name}", synthetic_elf(so["libraries"], so["versions"]))
        wheel.writestr("batchinv-0.1.0.dist-info/WHEEL", wheel_text)
    return path


def problems(checker, wheel: Path) -> list[str]:
    return checker.check_wheel(wheel, (2, 28))[1]


def test_reads_the_synthetic_elf(checker):
    needs = checker.elf_needs(synthetic_elf(GOOD_SO["libraries"], GOOD_SO["versions"]))
    assert needs.libraries == GOOD_SO["libraries"]
    assert needs.versions == {"GCC_3.0", "GCC_4.2.0", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.28"}


def test_reads_a_real_executable(checker):
    """The reader on a linker's output, not only on the synthetic layout above."""
    executable = Path(sys.executable).resolve()
    if executable.read_bytes()[:4] != b"\x7fELF":
        pytest.skip("the interpreter is not an ELF file")
    needs = checker.elf_needs(executable.read_bytes())
    assert any(lib.startswith("libc.so") for lib in needs.libraries)
    assert any(version.startswith("GLIBC_2.") for version in needs.versions)


@pytest.mark.parametrize(
    "tags",
    [["manylinux_2_28_x86_64"], ["manylinux_2_28_x86_64.manylinux_2_34_x86_64"]],
)
def test_passes_a_manylinux_2_28_wheel(checker, tmp_path, tags):
    wheel = make_wheel(tmp_path, tags, GOOD_SO)
    assert problems(checker, wheel) == []
    assert checker.main([str(wheel)]) == 0


@pytest.mark.parametrize(
    ("tags", "expected"),
    [
        (["manylinux_2_34_x86_64"], "asks for glibc 2.34"),
        (["linux_x86_64"], "is not manylinux"),
        (["manylinux_2_28_x86_64", "linux_x86_64"], "is not manylinux"),
        ([], "no Tag line"),
    ],
)
def test_fails_a_tag_pip_refuses_on_old_glibc(checker, tmp_path, tags, expected):
    wheel = make_wheel(tmp_path, tags, GOOD_SO)
    assert any(expected in p for p in problems(checker, wheel))
    assert checker.main([str(wheel)]) == 1


def test_fails_a_module_that_needs_newer_glibc(checker, tmp_path):
    # dlopen and pthread_* get GLIBC_2.34 versions when linked against glibc 2.34 or later.
    so = {"libraries": ["libc.so.6"], "versions": {"libc.so.6": ["GLIBC_2.17", "GLIBC_2.34"]}}
    found = problems(checker, make_wheel(tmp_path, ["manylinux_2_28_x86_64"], so))
    assert found == ["batchinv/_native.abi3.so needs GLIBC 2.34, above the 2.28 allowed"]


def test_fails_a_tag_lower_than_the_module_needs(checker, tmp_path):
    found = problems(checker, make_wheel(tmp_path, ["manylinux2014_x86_64"], GOOD_SO))
    assert found == ["batchinv/_native.abi3.so needs GLIBC 2.28, above the 2.17 allowed"]


def test_fails_a_module_linking_libcuda(checker, tmp_path):
    so = {"libraries": ["libcuda.so.1", "libc.so.6"], "versions": GOOD_SO["versions"]}
    found = problems(checker, make_wheel(tmp_path, ["manylinux_2_28_x86_64"], so))
    assert found == ["batchinv/_native.abi3.so links libraries outside glibc: libcuda.so.1"]


def test_fails_glibc_private(checker, tmp_path):
    so = {"libraries": ["libc.so.6"], "versions": {"libc.so.6": ["GLIBC_PRIVATE"]}}
    found = problems(checker, make_wheel(tmp_path, ["manylinux_2_28_x86_64"], so))
    assert found == ["batchinv/_native.abi3.so uses GLIBC_PRIVATE symbols"]


def test_fails_a_wheel_without_the_module(checker, tmp_path):
    found = problems(checker, make_wheel(tmp_path, ["manylinux_2_28_x86_64"]))
    assert found == ["no shared object in the wheel (the native module is missing)"]


def test_fails_a_module_that_is_not_elf(checker, tmp_path):
    wheel = make_wheel(tmp_path, ["manylinux_2_28_x86_64"])
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr("batchinv/_native.abi3.so", b"MZ not a Linux library")
    assert any("cannot read it as ELF" in p for p in problems(checker, wheel))


def test_legacy_names_map_to_their_glibc(checker):
    assert checker.glibc_of_platform_tag("manylinux2014_x86_64") == (2, 17)
    assert checker.glibc_of_platform_tag("manylinux_2_28_aarch64") == (2, 28)
    assert checker.glibc_of_platform_tag("musllinux_1_2_x86_64") is None
