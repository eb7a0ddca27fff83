"""dflash_train/machine.py: the facts recorded beside measured times."""

import os

from dflash_train.machine import cpu_facts, describe, machine_facts

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: some other name
flags\t\t: fpu
"""


def test_cpu_facts_read_the_first_processor():
    facts = cpu_facts(CPUINFO)
    assert facts == {"cpu": "Intel(R) Xeon(R) Platinum 8480+", "bf16_instructions": ["avx512_bf16", "amx_bf16", "amx_tile"]}
    no_amx = cpu_facts(CPUINFO.replace(" amx_bf16 amx_tile amx_int8", ""))
    assert no_amx["bf16_instructions"] == ["avx512_bf16"]
    assert "bf16 instructions: avx512_bf16" in describe({**no_amx, "cores": 2})
    assert describe({"cpu": "x", "cores": 2, "bf16_instructions": []}).endswith("bf16 instructions: none")


def test_machine_facts_here():
    facts = machine_facts()
    assert facts["cores"] == os.cpu_count() and facts["torch_threads"] >= 1 and facts["cpu"]
    if os.path.isfile("/proc/cpuinfo"):
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
        assert ("avx512_bf16" in flags) == ("avx512_bf16" in facts["bf16_instructions"])


def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    """CUDA and CPUs with AVX512-BF16 or AMX get bfloat16; AVX2-only CPUs, and CPUs whose oneDNN is capped
    below its bf16 instructions, get float32; each answer says why; DFLASH_AUTO_DTYPE pins the CPU's pick."""
    import pytest

    from dflash_train.errors import ConfigError
    from dflash_train.machine import auto_dtype

    monkeypatch.delenv("DFLASH_AUTO_DTYPE", raising=False)
    assert auto_dtype("cuda:0", []) == ("bfloat16", "CUDA")
    assert auto_dtype("cpu", ["avx512_bf16"], isa_cap="") == ("bfloat16", "this CPU has avx512_bf16")
    assert auto_dtype("cpu", ["amx_bf16", "amx_tile"], isa_cap="AVX512_CORE_AMX")[0] == "bfloat16"
    dtype, why = auto_dtype("cpu", [], isa_cap="")
    assert dtype == "float32" and "no bf16 instructions" in why
    dtype, why = auto_dtype("cpu", ["avx512_bf16"], isa_cap="avx2")
    assert dtype == "float32" and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")  # below AVX512_CORE_BF16: bf16 is emulated
    assert auto_dtype("cpu", ["avx512_bf16"])[0] == "float32"
    monkeypatch.setenv("DFLASH_AUTO_DTYPE", "bfloat16")
    assert auto_dtype("cpu", []) == ("bfloat16", "DFLASH_AUTO_DTYPE=bfloat16")
    assert auto_dtype("cuda", [])[0] == "bfloat16"
    monkeypatch.setenv("DFLASH_AUTO_DTYPE", "half")
    with pytest.raises(ConfigError, match="DFLASH_AUTO_DTYPE='half'"):
        auto_dtype("cpu", [])


def test_auto_dtype_reads_this_cpu(monkeypatch):
    from dflash_train.machine import auto_dtype

    monkeypatch.delenv("DFLASH_AUTO_DTYPE", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    has_bf16 = bool(machine_facts()["bf16_instructions"])
    assert auto_dtype("cpu")[0] == ("bfloat16" if has_bf16 else "float32")


# an aarch64 server's /proc/cpuinfo (Neoverse V1, Graviton 3): no `model name`, no `flags`; hwcaps in `Features`
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1

processor\t: 1
Features\t: fp asimd
"""


def test_cpu_facts_read_an_arm_cpu(monkeypatch):
    """An aarch64 /proc/cpuinfo: bf16 read from `Features`, the core named by its codes; `auto` keeps float32
    there and says why and how to try bf16."""
    from dflash_train.machine import auto_dtype

    monkeypatch.delenv("DFLASH_AUTO_DTYPE", raising=False)

    facts = cpu_facts(ARM_CPUINFO)
    assert facts == {"cpu": "CPU implementer 0x41 CPU part 0xd40", "bf16_instructions": ["bf16"]}
    assert describe({**facts, "cores": 64}).endswith("64 cores, bf16 instructions: bf16")
    assert cpu_facts(ARM_CPUINFO.replace(" bf16 dgh", " dgh"))["bf16_instructions"] == []  # svebf16 is not bf16
    dtype, why = auto_dtype("cpu", facts["bf16_instructions"], isa_cap="")
    assert dtype == "float32" and "Arm CPU has bf16" in why and "DFLASH_AUTO_DTYPE=bfloat16" in why
    assert auto_dtype("cpu", ["FEAT_BF16"], isa_cap="")[0] == "float32"  # Apple M2 and later
    assert auto_dtype("cpu", ["avx512_bf16", "bf16"], isa_cap="")[0] == "bfloat16"


def test_this_cpu_names_an_arm_core_by_lscpu(monkeypatch, tmp_path):
    """Where /proc/cpuinfo names no model (aarch64), lscpu's `Model name` does; without lscpu the codes stay."""
    import dflash_train.machine as machine

    real_path = machine.Path

    def fake_path(name):  # /proc/cpuinfo read from a file of the test's
        return tmp_path / "cpuinfo" if name == "/proc/cpuinfo" else real_path(name)

    (tmp_path / "cpuinfo").write_text(ARM_CPUINFO)
    monkeypatch.setattr(machine, "Path", fake_path)
    lscpu = "Architecture:             aarch64\nVendor ID:                ARM\nModel name:               Neoverse-V1\n"
    calls = []
    monkeypatch.setattr(machine, "_command_output", lambda *argv: calls.append(argv) or lscpu)
    machine._this_cpu.cache_clear()
    try:
        facts = machine.this_cpu()
        assert facts == {"cpu": "Neoverse-V1", "bf16_instructions": ["bf16"]} and calls == [("lscpu",)]
        facts["bf16_instructions"].append("x")  # a copy: the cached facts stay
        assert machine.cpu_bf16_instructions() == ["bf16"] and len(calls) == 1  # read once a process
        machine._this_cpu.cache_clear()
        monkeypatch.setattr(machine, "_command_output", lambda *argv: "")
        assert machine.this_cpu()["cpu"] == "CPU implementer 0x41 CPU part 0xd40"
    finally:
        machine._this_cpu.cache_clear()


def test_command_output_of_a_missing_tool_is_empty():
    from dflash_train.machine import _command_output

    assert _command_output("dflash-no-such-tool-here") == ""
    assert "Model name" in _command_output("lscpu") or not __import__("shutil").which("lscpu")
