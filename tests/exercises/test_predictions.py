"""Predict, then measure (exercises/predictions.py): the sentence next to each measurement, the
record in the learner's folder, and an unanswered prediction that stops nothing."""
import json

import pytest

from minipaged.exercises import predictions
from minipaged.exercises.workbench import LEARNER_DIR_VARIABLE


@pytest.fixture
def learner(tmp_path, monkeypatch):
    monkeypatch.setenv(LEARNER_DIR_VARIABLE, str(tmp_path))
    return tmp_path


def test_no_prediction_prints_the_measurement_and_keeps_nothing(learner, capsys):
    assert predictions.compare("03", "blocks after a fork", None, 6, unit="blocks") is None
    out = capsys.readouterr().out
    assert "measured: 6 blocks (blocks after a fork)" in out and "my_prediction" in out
    assert not (learner / predictions.FILE_NAME).exists()
    assert predictions.record() == []


def test_a_right_and_a_wrong_guess(learner, capsys):
    right = predictions.compare("03", "blocks after a fork", 6, 6, unit="blocks")
    close = predictions.compare("09", "steps to the first token", 11, 10, unit="steps")
    wrong = predictions.compare("10", "copies in a beam search", 40, 10, unit="copies",
                                why="only a shared last block is copied, once per beam")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("you predicted 6 blocks, measured 6 blocks (blocks after a fork): right: "
                      "your picture of it holds.")
    assert "right (within 10 %)" in out[1]
    assert out[2] == ("you predicted 40 copies, measured 10 copies (copies in a beam search): "
                      "4.0x too high. only a shared last block is copied, once per beam")
    assert right.right and close.right and not wrong.right
    kept = predictions.record()
    assert [p.question for p in kept] == ["blocks after a fork", "steps to the first token",
                                          "copies in a beam search"]
    assert json.loads((learner / predictions.FILE_NAME).read_text())[2]["predicted"] == 40


def test_the_summary_puts_wrong_guesses_first_and_counts_the_newest_answer(learner, capsys):
    predictions.compare("03", "blocks after a fork", 3, 6)
    predictions.compare("03", "blocks after a fork", 6, 6)  # answered again: right now
    predictions.compare("15", "batch where decode stops speeding up", 8, 64, unit="sequences")
    table = predictions.summary()
    lines = table.splitlines()
    assert lines[2].startswith("| 15 | batch where decode stops speeding up | 8 sequences | "
                               "64 sequences | 88% |")
    assert lines[3] == "| 03 | blocks after a fork | 6 | 6 | right |"
    assert lines[-1] == "1 of 2 predictions within 10 % of the measurement."


def test_an_empty_record_says_how_it_fills(learner):
    assert "No predictions kept yet" in predictions.summary()


@pytest.mark.parametrize("bad", ["six", [6], True, float("nan")])
def test_a_prediction_that_is_not_a_number_is_named(learner, bad):
    with pytest.raises(ValueError, match="my_prediction must be a number"):
        predictions.compare("03", "blocks after a fork", bad, 6)


def test_a_broken_record_file_reads_as_empty(learner):
    (learner / predictions.FILE_NAME).write_text("{not json")
    assert predictions.record() == []
    predictions.compare("01", "bytes per token", 100, 100)  # and is written anew
    assert len(predictions.record()) == 1


def test_zero_measured(learner, capsys):
    assert predictions.compare("04", "preemptions", 0, 0).right
    assert not predictions.compare("04", "preemptions", 2, 0).right
    assert "too high" in capsys.readouterr().out


def test_units_read_as_words(learner, capsys):
    predictions.compare("04", "preemptions by swap", 2, 1, unit="preemptions")
    predictions.compare("01", "slots holding no token", 70, 73.3, unit="%")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("you predicted 2 preemptions, measured 1 preemption ")
    assert out[1].startswith("you predicted 70%, measured 73.3% ")
