"""The loracc command: dump and explain, on presets, a local Hugging Face directory and module:function."""
from __future__ import annotations

import json

import pytest

from loracc import presets
from loracc.cli import main


def test_dump_preset_prints_every_stage_and_writes_dot_and_json(tmp_path, capsys):
    pytest.importorskip("peft")
    assert main(["dump", "llama", "--region", "block", "--out", str(tmp_path), "--seq", "9"]) == 0
    text = capsys.readouterr().out
    for stage in ("captured", "cleanup", "lora_match", "joint", "forward", "backward"):
        assert f"after {stage}" in text
    assert "loracc.lora_linear(" in text and "loracc.lora_linear_backward(" in text
    assert "saved" in text
    stage_dir = next(tmp_path.iterdir())
    record = json.loads((stage_dir / "lora_match.json").read_text())
    assert record["report"]["matched"] == 7
    assert any(n["target"] == "loracc.lora_linear" for n in record["nodes"])
    assert (stage_dir / "backward.dot").read_text().startswith("digraph")


def test_dump_one_stage_of_the_plain_preset(capsys):
    assert main(["dump", "plain", "--stage", "lora_match"]) == 0
    text = capsys.readouterr().out
    assert "after lora_match" in text and "after joint" not in text


def test_explain_on_a_local_hugging_face_directory(tmp_path, capsys):
    pytest.importorskip("peft")
    presets.hf_decoder("qwen2").save_pretrained(tmp_path)
    assert main(["explain", str(tmp_path), "--r", "4", "--targets", "q_proj", "v_proj", "--seq", "7"]) == 0
    text = capsys.readouterr().out
    assert "4 in the model, 4 matched" in text  # 2 layers × (q, v)


def test_module_function_source(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_model.py").write_text(
        "from loracc import presets\n\ndef build():\n    return presets.plain()\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "my_model:build"]) == 0
    assert "6 matched" in capsys.readouterr().out


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["explain", "not-a-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_dtype_option_casts_the_example_batch(capsys):
    assert main(["explain", "plain", "--dtype", "bfloat16"]) == 0
    assert "6 matched" in capsys.readouterr().out


def test_dump_memory_plots_the_step_before_and_after_remat(tmp_path, capsys):
    pytest.importorskip("peft")
    assert main(["dump", "llama", "--region", "block", "--seq", "64", "--memory", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "before: peak" in text and "after: peak" in text and "###" in text
    timeline = json.loads(next(tmp_path.glob("*/memory.json")).read_text())
    # The fastest plan saves less than everything the backward reads, over both layers.
    assert max(timeline["after"]) < max(timeline["before"])
    assert len(timeline["after"]) > len(timeline["before"]) / 2
