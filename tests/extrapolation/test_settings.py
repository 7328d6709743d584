"""A study of its own: `--set FIELD=VALUE` read as each field's type (bad input named), the settings that differ from
the defaults on the results page, and the SSMax scales' own rate and start reaching both stages of an SSMax encoding
only."""

import sys
from pathlib import Path

import pytest
from helpers import checkout_environment
from waiting import run_within

from bam_llama.extrapolation import stages
from bam_llama.extrapolation.encodings import ENCODINGS
from bam_llama.extrapolation.report import write_report
from bam_llama.extrapolation.settings import QUICK, Study, changed_settings, with_settings

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "text_extrapolation.py"


def test_set_reads_each_kind_of_setting():
    study = with_settings(Study(), ["steps=4000", "ssmax_learning_rate=1e-3", "scales=1,2,4", " max_train_characters = none",
                                    "passkey_share=0.25", "hidden_size=192", "ssmax_scale_init=0.2061"])
    assert (study.steps, study.ssmax_learning_rate, study.scales) == (4000, 1e-3, (1, 2, 4))
    assert study.ssmax_scale_init == 0.2061
    assert (study.max_train_characters, study.passkey_share, study.hidden_size) == (None, 0.25, 192)
    assert with_settings(Study(), []) == Study()
    assert with_settings(Study(), ["uniform_head_layer=0"]).uniform_head_layer == 0  # a layer index: 0 is the first


@pytest.mark.parametrize("assignment,message", [
    ("nonsense=1", "expected FIELD=VALUE with FIELD among"),
    ("steps", "expected FIELD=VALUE"),
    ("validation_seeds=1,2", "expected FIELD=VALUE"),  # the seeds have flags of their own
    ("steps=1.5", "steps takes int"),
    ("steps=none", "steps takes int"),  # not a setting that may be None
    ("steps=0", "steps must be positive"),
    ("ssmax_learning_rate=-1e-3", "ssmax_learning_rate must be positive"),
    ("passkey_share=1.5", r"passkey_share must be in \(0, 1\]"),
    ("scales=1,0,4", "scales must be positive"),
    ("scales=1,x", "scales takes tuple"),
    ("uniform_head_layer=-1", "uniform_head_layer must be >= 0"),
    ("uniform_head_layer=4", "uniform_head_layer=4: a layer of the model's 4"),
])
def test_set_names_the_assignment_that_is_not_one(assignment, message):
    with pytest.raises(ValueError, match=message):
        with_settings(Study(), [assignment])


def test_the_changed_settings_are_those_that_differ_from_the_default_study():
    assert changed_settings(Study()) == [] and changed_settings(QUICK) == []
    assert changed_settings(Study(validation_seeds=(7,), test_seeds=(8,))) == []  # the seeds are shown apart
    assert changed_settings(Study(steps=4000, ssmax_learning_rate=1e-3)) == ["steps=4000", "ssmax_learning_rate=0.001"]
    page = write_report({"jobs": {}, "choices": {}}, Study(ssmax_learning_rate=1e-3))
    assert "settings other than the study's defaults: ssmax_learning_rate=0.001)" in page.splitlines()[2]
    assert "settings other than" not in write_report({"jobs": {}, "choices": {}}, Study())


def test_the_ssmax_rate_and_start_reach_both_stages_of_an_ssmax_encoding_only(tmp_path):
    study = Study(ssmax_learning_rate=1e-3, ssmax_scale_init=0.25, shape_learning_rate=5e-2, extension_rate_factor=0.1)
    for name, ssmax in (("bam-ssmax", True), ("rope-ssmax", True), ("alibi-ssmax", True), ("bam", False), ("alibi", False)):
        encoding = ENCODINGS[name]
        for trial in encoding.trials.values():
            args = stages.pretrain_arguments(encoding, trial, study, 100, tmp_path, tmp_path, tmp_path, None)
            assert (args.ssmax_learning_rate, args.ssmax_scale_init) == ((1e-3, 0.25) if ssmax else (None, None)), name
    trial = ENCODINGS["bam-ssmax"].trials["lr-1e-3"]
    unset = stages.pretrain_arguments(ENCODINGS["bam-ssmax"], trial, Study(), 100, tmp_path, tmp_path, tmp_path, None)
    assert (unset.ssmax_learning_rate, unset.ssmax_scale_init) == (None, None)  # the shape rate and the models' start

    for ssmax, rate in ((True, 1e-4), (False, None)):
        args = stages.extension_arguments(tmp_path, trial, study, 100, tmp_path, tmp_path, ssmax=ssmax)
        assert args.ssmax_learning_rate == pytest.approx(rate) if rate else args.ssmax_learning_rate is None
        assert args.prior_learning_rate == pytest.approx(5e-3) and args.learning_rate == pytest.approx(1e-4)


def test_the_command_refuses_a_bad_setting_in_one_line_before_it_loads_anything(tmp_path):
    command = [sys.executable, str(BENCHMARK), "--report-only", "--set", "steps=0", "--output-dir", str(tmp_path)]
    result = run_within(command, 120, env=checkout_environment())
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("error: --set steps=0: steps must be positive")
    assert not any(tmp_path.iterdir())
    command[3:5] = ["--trials", "two-stage,nonsense"]
    result = run_within(command, 120, env=checkout_environment())
    assert result.returncode == 2 and "argument --trials: distinct names among" in result.stderr.splitlines()[-1]
    assert not any(tmp_path.iterdir())
