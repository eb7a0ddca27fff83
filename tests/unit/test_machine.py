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
