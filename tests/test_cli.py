"""The loracc command: dump, explain and check, on presets, a local Hugging Face directory and module:function."""
from __future__ import annotations

import json

import pytest
import torch

from loracc.tools import presets
from loracc.tools.cli import main


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
        "from loracc.tools import presets\n\ndef build():\n    return presets.plain()\n"
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


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A planted pass must not reach a shared trace cache."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LORACC_TRACE_CACHE", "0")


def _table(text: str) -> dict:
    """The check table's rows by region name: [programs, outputs, gradients, tolerance, result]."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("region "))
    rows = {}
    for line in lines[start + 1:]:
        cells = line.rsplit(None, 5)
        if len(cells) != 6 or cells[-1] not in ("PASS", "MISMATCH", "FALLBACK", "UNCALLED"):
            break
        rows[cells[0].strip()] = cells[1:]
    return rows


def test_check_preset_prints_a_passing_row_per_region(private_cache, capsys):
    pytest.importorskip("peft")
    assert main(["check", "llama", "--seq", "9"]) == 0
    rows = _table(capsys.readouterr().out)
    step = rows.pop("whole step vs an eager copy (loss, every trainable parameter)")
    assert step[-1] == "PASS" and float(step[1]) <= 1e-5 and 0 < float(step[2]) <= 1e-5
    assert len(rows) == 2 and any(name.startswith("head") for name in rows)
    for name, (programs, outputs, gradients, tolerance, result) in rows.items():
        assert result == "PASS" and int(programs) >= 1 and tolerance == "1e-04", name
        assert float(outputs) <= 1e-5 and 0 < float(gradients) <= 1e-5, name


def test_check_reports_a_mismatch_and_exits_with_1(private_cache, capsys, monkeypatch):
    from loracc import pipeline
    from test_verify import _flip_first_gradient

    real_fusion = pipeline.fusion
    monkeypatch.setattr(pipeline, "fusion", lambda gm: _flip_first_gradient(real_fusion(gm)))
    with pytest.warns(UserWarning, match="differs from eager"):
        assert main(["check", "plain"]) == 1
    text = capsys.readouterr().out
    rows = _table(text)
    programs, outputs, gradients, tolerance, result = next(row for name, row in rows.items() if name.startswith("blocks"))
    assert result == "MISMATCH" and programs == "1" and float(gradients) == pytest.approx(2.0, rel=1e-3)
    assert rows["whole step vs an eager copy (loss, every trainable parameter)"][-1] == "PASS"  # ran eagerly
    assert "verify:" in text and "runs eagerly from now on" in text


def test_check_a_model_alone_from_module_function(private_cache, tmp_path, capsys, monkeypatch):
    """A function may return a Hugging Face causal LM alone: it gets a batch of random tokens. PEFT's
    zero LoRA B is given values so that the gradients of A are checked too."""
    pytest.importorskip("peft")
    (tmp_path / "user_model.py").write_text(
        "from peft import LoraConfig, get_peft_model\n"
        "from loracc.tools import presets\n\n"
        "def build():\n"
        "    return get_peft_model(presets.hf_decoder('qwen2'), LoraConfig(r=4, target_modules=['q_proj', 'v_proj']))\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["check", "user_model:build", "--seq", "7"]) == 0
    text = capsys.readouterr().out
    assert "got small random values" in text
    rows = _table(text)
    assert len(rows) == 3 and all(row[-1] == "PASS" and float(row[2]) > 0 for row in rows.values())


def test_check_whole_step_sees_what_a_first_call_does_not(private_cache, capsys, monkeypatch):
    """A planted bug that spares each program's first call (as one that needs several layers in
    sequence would): every region passes, the whole step against the eager copy does not."""
    from loracc.runtime import region

    verified = set()  # the programs past their verification
    real_verify, real_backward = region.verification.verify_call, region._RegionFunction.backward

    def verify_call(program, *args, **kwargs):
        result = real_verify(program, *args, **kwargs)
        verified.add(id(program))
        return result

    def backward(ctx, *grad_outputs):
        grads = real_backward(ctx, *grad_outputs)
        return tuple(-g if g is not None and id(ctx.program) in verified else g for g in grads)

    monkeypatch.setattr(region.verification, "verify_call", verify_call)
    monkeypatch.setattr(region._RegionFunction, "backward", staticmethod(backward))
    assert main(["check", "plain"]) == 1
    rows = _table(capsys.readouterr().out)
    step = rows.pop("whole step vs an eager copy (loss, every trainable parameter)")
    assert [row[-1] for row in rows.values()] == ["PASS"] and step[-1] == "MISMATCH"
    assert float(step[1]) <= 1e-5 and float(step[2]) > 1.0


def test_check_in_bf16_judges_against_fp32_where_two_bf16_runs_differ(private_cache, capsys, monkeypatch):
    """With a bf16 tolerance no two bf16 computations meet, every row is judged against fp32 runs."""
    from loracc.runtime import verify

    monkeypatch.setitem(verify.TOLERANCES, torch.bfloat16, 1e-9)
    assert main(["check", "plain", "--dtype", "bfloat16"]) == 0
    rows = _table(capsys.readouterr().out)
    assert len(rows) == 2 and all(row[-1] == "PASS" and float(row[2]) > 1e-9 for row in rows.values())


def test_check_shows_a_region_that_runs_eagerly_as_fallback_with_its_reason(private_cache, tmp_path, capsys, monkeypatch):
    pytest.importorskip("peft")
    (tmp_path / "hooked_model.py").write_text(
        "from loracc.tools import presets\n\n"
        "def build():\n"
        "    model, batch = presets.preset('llama', seq=7)\n"
        "    model.base_model.model.model.norm.register_forward_hook(lambda module, args, output: None)\n"
        "    return model, batch\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="has hooks"):
        assert main(["check", "hooked_model:build"]) == 0
    text = capsys.readouterr().out
    rows = _table(text)
    head = next(row for name, row in rows.items() if name.startswith("head"))
    assert head[0] == "0" and head[-1] == "FALLBACK"
    assert [row[-1] for name, row in rows.items() if not name.startswith("head")] == ["PASS", "PASS"]
    assert "norm+lm_head+loss: the final norm or lm_head has hooks" in text
