"""convert-fla: fla GatedDeltaNet / DeltaNet checkpoints into deltaflow models, same logits.

Without fla (CI): checkpoints are built by hand in fla's format (names, shapes, config.json)
and the converted model is checked against `_fla_forward`, a token-by-token restatement of
fla 0.6.0's forward written here from its layer code. With fla importable (and Triton, for
its interpreter on CPU) a tiny random fla model is compared as well, in a subprocess so that
TRITON_INTERPRET never reaches this process.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from deltaflow.cli import main
from deltaflow.models import DeltaFlowForCausalLM
from deltaflow.models.convert_fla import convert_fla

REPO = Path(__file__).resolve().parents[1]
V, H, LAYERS = 61, 24, 2


def _gdn_config(**kw) -> dict:
    cfg = {
        "model_type": "gated_deltanet",
        "architectures": ["GatedDeltaNetForCausalLM"],
        "hidden_size": H,
        "num_hidden_layers": LAYERS,
        "num_heads": 2,
        "head_dim": 8,
        "expand_v": 1.5,
        "num_v_heads": 4,
        "use_gate": True,
        "use_short_conv": True,
        "allow_neg_eigval": True,
        "conv_size": 3,
        "hidden_ratio": 4,
        "intermediate_size": None,
        "hidden_act": "swish",
        "norm_eps": 1e-6,
        "attn": None,
        "vocab_size": V,
        "tie_word_embeddings": False,
        "fuse_norm": True,
        "fuse_swiglu": True,
        "fuse_cross_entropy": True,
        "attn_mode": "chunk",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "transformers_version": "5.6.2",
    }
    cfg.update(kw)
    return cfg


def _dn_config(**kw) -> dict:
    cfg = {
        "model_type": "delta_net",
        "hidden_size": H,
        "num_hidden_layers": LAYERS,
        "num_heads": 3,
        "expand_k": 1.0,
        "expand_v": 2.0,
        "use_gate": True,
        "use_beta": True,
        "use_short_conv": True,
        "use_output_norm": True,
        "qk_norm": "l2",
        "qk_activation": "silu",
        "allow_neg_eigval": False,
        "conv_size": 4,
        "intermediate_size": 40,
        "hidden_act": "swish",
        "norm_eps": 1e-5,
        "vocab_size": V,
        "tie_word_embeddings": True,
    }
    cfg.update(kw)
    return cfg


def _dims(cfg: dict) -> dict:
    if cfg["model_type"] == "gated_deltanet":
        h, dk = cfg["num_heads"], cfg["head_dim"]
        hv = cfg.get("num_v_heads") or h
        dv = int(dk * cfg["expand_v"])
    else:
        h = hv = cfg["num_heads"]
        dk = int(cfg["hidden_size"] * cfg["expand_k"]) // h
        dv = int(cfg["hidden_size"] * cfg["expand_v"]) // h
    ffn = cfg.get("intermediate_size") or 256 * ((int(H * 4 * 2 / 3) + 255) // 256)
    return {"h": h, "hv": hv, "dk": dk, "dv": dv, "ffn": ffn}


def _fla_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under fla's names and shapes (norm weights away from 1)."""
    g = torch.Generator().manual_seed(seed)
    d = _dims(cfg)
    kd, vd, W = d["h"] * d["dk"], d["hv"] * d["dv"], cfg["conv_size"]

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embeddings.weight": r(V, H, scale=1.0), "model.norm.weight": 1 + r(H, scale=0.1)}
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = r(V, H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd |= {
            p + "attn_norm.weight": 1 + r(H, scale=0.1),
            p + "mlp_norm.weight": 1 + r(H, scale=0.1),
            p + "attn.q_proj.weight": r(kd, H),
            p + "attn.k_proj.weight": r(kd, H),
            p + "attn.v_proj.weight": r(vd, H),
            p + "attn.b_proj.weight": r(d["hv"], H),
            p + "attn.o_proj.weight": r(H, vd),
            p + "attn.g_proj.weight": r(vd, H),
            p + "attn.o_norm.weight": 1 + r(d["dv"], scale=0.1),
            p + "attn.q_conv1d.weight": r(kd, 1, W, scale=0.5),
            p + "attn.k_conv1d.weight": r(kd, 1, W, scale=0.5),
            p + "attn.v_conv1d.weight": r(vd, 1, W, scale=0.5),
            p + "mlp.gate_proj.weight": r(d["ffn"], H),
            p + "mlp.up_proj.weight": r(d["ffn"], H),
            p + "mlp.down_proj.weight": r(H, d["ffn"]),
        }
        if cfg["model_type"] == "gated_deltanet":
            sd |= {
                p + "attn.a_proj.weight": r(d["hv"], H),
                p + "attn.A_log": torch.rand(d["hv"], generator=g).mul(16).clamp_min(1e-2).log(),
                p + "attn.dt_bias": r(d["hv"], scale=1.0),
            }
    return sd


def _write(folder: Path, cfg: dict, sd: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    return folder


# ------------------------------------------------------------------ fla's forward, restated
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _fla_forward(cfg: dict, sd: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """fla 0.6.0's GatedDeltaNet / DeltaNet LM, one token at a time, in float64."""
    sd = {k: v.double() for k, v in sd.items()}
    d, eps, gated = _dims(cfg), cfg["norm_eps"], cfg["model_type"] == "gated_deltanet"
    B, T = ids.shape
    h = sd["model.embeddings.weight"][ids]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        x = _rms(h, sd[p + "attn_norm.weight"], eps)

        def conv(name: str, y: torch.Tensor, p: str = p) -> torch.Tensor:  # depthwise, SiLU
            w = sd[p + f"attn.{name}_conv1d.weight"][:, 0]  # [C, W]
            padded = F.pad(y, (0, 0, w.shape[1] - 1, 0))
            return F.silu(sum(padded[:, j : j + T] * w[:, j] for j in range(w.shape[1])))

        q = conv("q", x @ sd[p + "attn.q_proj.weight"].T).view(B, T, d["h"], d["dk"])
        k = conv("k", x @ sd[p + "attn.k_proj.weight"].T).view(B, T, d["h"], d["dk"])
        v = conv("v", x @ sd[p + "attn.v_proj.weight"].T).view(B, T, d["hv"], d["dv"])
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(x @ sd[p + "attn.b_proj.weight"].T)
        if cfg["allow_neg_eigval"]:
            beta = 2 * beta
        if gated:
            a = x @ sd[p + "attn.a_proj.weight"].T + sd[p + "attn.dt_bias"]
            log_alpha = -torch.exp(sd[p + "attn.A_log"]) * F.softplus(a)
        group = d["hv"] // d["h"]
        o = torch.zeros(B, T, d["hv"], d["dv"], dtype=torch.float64)
        for b in range(B):
            for j in range(d["hv"]):
                S = torch.zeros(d["dv"], d["dk"], dtype=torch.float64)  # fla's [V, K] state
                for t in range(T):
                    kt, qt = k[b, t, j // group], q[b, t, j // group]
                    if gated:
                        S = S * torch.exp(log_alpha[b, t, j])
                    S = S + torch.outer(beta[b, t, j] * (v[b, t, j] - S @ kt), kt)
                    o[b, t, j] = S @ qt / math.sqrt(d["dk"])
        gate = (x @ sd[p + "attn.g_proj.weight"].T).view(B, T, d["hv"], d["dv"])
        o = _rms(o, sd[p + "attn.o_norm.weight"], eps) * F.silu(gate)
        h = h + o.reshape(B, T, -1) @ sd[p + "attn.o_proj.weight"].T
        y = _rms(h, sd[p + "mlp_norm.weight"], eps)
        up = F.silu(y @ sd[p + "mlp.gate_proj.weight"].T) * (y @ sd[p + "mlp.up_proj.weight"].T)
        h = h + up @ sd[p + "mlp.down_proj.weight"].T
    head = sd["model.embeddings.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"]
    return _rms(h, sd["model.norm.weight"], eps) @ head.T


def _converted_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = DeltaFlowForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("cfg", [_gdn_config(), _dn_config()], ids=["gated_deltanet", "delta_net"])
def test_converted_model_matches_fla_semantics(tmp_path: Path, cfg: dict) -> None:
    sd = _fla_state(cfg)
    src = _write(tmp_path / "fla", cfg, sd)
    (src / "tokenizer.json").write_text("{}")  # tokenizer files travel with the weights
    out = convert_fla(src, tmp_path / "df")
    assert (out / "tokenizer.json").is_file()
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    want = _fla_forward(cfg, sd, ids)
    got = _converted_logits(out, ids)
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (got - want).abs().max()
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == cfg.get("eos_token_id", 2)  # fla's default: 2
    assert config["tie_word_embeddings"] == cfg["tie_word_embeddings"]


def test_absent_config_fields_take_fla_defaults(tmp_path: Path) -> None:
    """save_pretrained may leave out fields at their defaults: fla's defaults apply."""
    cfg = _dn_config()
    sd = _fla_state(cfg)
    defaults = ("expand_k", "use_beta", "qk_norm", "qk_activation", "hidden_act", "use_short_conv")
    short = {k: v for k, v in cfg.items() if k not in defaults}
    out = convert_fla(_write(tmp_path / "fla", short, sd), tmp_path / "df")
    ids = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(_converted_logits(out, ids), _fla_forward(cfg, sd, ids), atol=2e-4)


def test_bf16_weights_stay_bf16(tmp_path: Path) -> None:
    cfg = _gdn_config(num_v_heads=None, allow_neg_eigval=False, use_gate=False)
    sd = {k: v.bfloat16() for k, v in _fla_state(cfg).items() if "g_proj" not in k}
    out = convert_fla(_write(tmp_path / "fla", cfg, sd), tmp_path / "df")
    model = DeltaFlowForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    got = model.state_dict()
    assert got["model.layers.1.mixer.A_log"].dtype == torch.bfloat16
    assert torch.equal(got["model.layers.1.mixer.A_log"], sd["model.layers.1.attn.A_log"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn": {"layers": [1], "num_heads": 2}}, "attn="),
        ({"hidden_act": "powlu"}, "hidden_act='powlu'"),
        ({"output_gate_activation": "sigmoid"}, "output_gate_activation='sigmoid'"),
        ({"attnres_block_size": 2}, "attnres_block_size=2"),
        ({"some_new_switch": True}, "unknown config fields ['some_new_switch']"),
        ({"model_type": "llama"}, "model_type 'llama'"),
        ({"num_v_heads": 3}, "num_v_heads=3"),
    ],
)
def test_unrepresentable_settings_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    cfg = _gdn_config()
    src = _write(tmp_path / "fla", cfg | change, _fla_state(cfg))
    with pytest.raises(ValueError, match="^(cannot convert|config.json has)") as err:
        convert_fla(src, tmp_path / "df")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "df").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [({"qk_activation": "relu"}, "qk_activation='relu'"), ({"use_beta": False}, "use_beta=False")],
)
def test_deltanet_settings_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    cfg = _dn_config()
    src = _write(tmp_path / "fla", cfg | change, _fla_state(cfg))
    with pytest.raises(ValueError, match=message):
        convert_fla(src, tmp_path / "df")


def test_weights_must_match_the_config(tmp_path: Path) -> None:
    cfg = _gdn_config()
    sd = _fla_state(cfg)
    extra = sd | {"model.layers.0.attn.q_conv1d.bias": torch.zeros(16)}
    with pytest.raises(ValueError, match="no deltaflow counterpart.*q_conv1d.bias"):
        convert_fla(_write(tmp_path / "a", cfg, extra), tmp_path / "a_out")
    short = {k: v for k, v in sd.items() if "layers.1.attn.dt_bias" not in k}
    with pytest.raises(ValueError, match="lacks weights.*layers.1.attn.dt_bias"):
        convert_fla(_write(tmp_path / "b", cfg, short), tmp_path / "b_out")
    with pytest.raises(ValueError, match="shape"):
        convert_fla(_write(tmp_path / "c", cfg | {"head_dim": 4}, sd), tmp_path / "c_out")


def test_cli_convert_fla(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _dn_config()
    src = _write(tmp_path / "fla", cfg, _fla_state(cfg))
    assert main(["convert-fla", str(src), "--out", str(tmp_path / "df")]) == 0
    assert "converted" in capsys.readouterr().out
    assert main(["convert-fla", str(src), "--out", str(tmp_path / "df")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deltaflow convert-fla: error:") and "exists" in err
    assert main(["convert-fla", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err


# ------------------------------------------------------------------ against fla itself
def _fla_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("fla", "triton", "einops"))


@pytest.mark.skipif(not _fla_available(), reason="fla (flash-linear-attention) not installed")
@pytest.mark.parametrize("kind", ["gdn", "dn"])
def test_converted_model_matches_fla(tmp_path: Path, kind: str) -> None:
    """A tiny random fla model (fla's kernels under the Triton interpreter on CPU, float32)
    and its conversion give the same logits (fla's fused_recurrent kernels: its chunk kernels
    fail under the Triton 3.9 interpreter)."""
    env = os.environ | {"TRITON_INTERPRET": "1"}
    script = REPO / "benchmarks" / "convert_fla_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--model", kind, "--work", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max abs" in done.stdout
