"""What results pages record of the processor (issue 48): "Intel(R) Xeon(R) Processor" alone does not tell two
generations apart, whose CPU kernels round differently; the family and model do."""

import torch

from bam_llama.runtime.processor import cpu_fields, cpu_model

TWO_PROCESSORS = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 167
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
"""


def test_the_first_processors_name_family_and_model_are_read():
    assert cpu_fields(TWO_PROCESSORS) == {"cpu family": "6", "model": "167", "model name": "Intel(R) Xeon(R) Processor"}


def test_a_model_name_is_not_read_as_the_model_number():
    """`model name` and `model` share a prefix: each is its own field."""
    assert cpu_fields("model name\t: X\nmodel\t\t: 7\n") == {"model name": "X", "model": "7"}


def test_the_description_names_the_kernels_pytorch_uses_here():
    assert cpu_model().endswith(f", PyTorch CPU kernels: {torch.backends.cpu.get_cpu_capability()}")
