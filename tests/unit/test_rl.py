"""miles.rl: prompt data, rewards, GRPO advantages, policy-gradient loss."""

from __future__ import annotations

import math
import types

import pytest
import torch

from miles.rl import (
    PromptDataError,
    PromptItem,
    PromptSource,
    arithmetic_reward,
    arithmetic_task,
    collate_samples,
    compute_rewards,
    default_reward,
    grpo_advantages,
    load_prompt_data,
    make_prompt_source,
    policy_gradient_loss,
    text_match_reward,
    token_level_advantages,
    token_logprobs,
)

# ------------------------------------------------------------------------------------------- data


def test_load_prompt_data(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1+1?", "answer": 2}\n\n{"prompt": "capital of France?", "answer": "Paris", "id": 7}\n')
    items = load_prompt_data(str(p))
    assert items == [PromptItem("1+1?", "2"), PromptItem("capital of France?", "Paris")]
    assert items[1].metadata == {"id": 7}


@pytest.mark.parametrize(
    "content,msg",
    [
        ('{"prompt": "a", "answer": "b"}\n{"prompt": "a", "answer": \n', ":2: not valid JSON"),
        ('{"prompt": "a", "answer": "b"}\n\n[1, 2]\n', ":3: expected a JSON object, got list"),
        ('{"prompt": "a"}\n', ':1: missing key "answer"'),
        ('{"answer": "a"}\n', ':1: missing key "prompt"'),
        ('{"prompt": "", "answer": "a"}\n', ':1: "prompt" must be a non-empty string'),
        ('{"prompt": "x", "answer": null}\n', ':1: "answer" must be a string or a number'),
        ("\n\n", ": no prompts (the file is empty)"),
    ],
)
def test_malformed_prompt_data(tmp_path, content, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(PromptDataError) as ei:
        load_prompt_data(str(p))
    assert str(ei.value).startswith(str(p) + msg)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(PromptDataError, match="cannot open prompt data"):
        load_prompt_data(str(tmp_path / "nope.jsonl"))


def test_builtin_task_and_source(make_config):
    items = arithmetic_task(num_prompts=50, seed=3)
    assert items == arithmetic_task(num_prompts=50, seed=3)
    for it in items:
        a, b = [int(x) for x in it.prompt.split("What is ")[1].split("?")[0].split(" + ")]
        assert int(it.answer) == a + b
    src = PromptSource(items[:5], seed=1)
    batches = [src.get_batch(r, 2) for r in range(5)]  # 10 prompts = 2 epochs of 5
    assert all(len(b) == 2 for b in batches)
    first_epoch = [x for b in batches[:2] for x in b] + [batches[2][0]]
    assert sorted(x.prompt for x in first_epoch) == sorted(x.prompt for x in items[:5])
    assert src.get_batch(3, 2) == batches[3]  # deterministic
    assert len(make_prompt_source(make_config("--rollout-seed", "0"))) == 256


# ------------------------------------------------------------------------------------------ rewards


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("7", "7", 1.0),
        ("7.", "7", 1.0),
        ("3 + 4 = 7", "7", 0.5 + 0.3 + 0.2 * 3 / 5),
        ("The answer is 8", "7", 0.3 * (1 - 1 / 7) + 0.2 * 1 / 12),
        ("no idea", "7", 0.0),
        ("", "7", 0.0),
        ("100", "7", 0.2),  # far off: closeness 0, all digits
        ("-3", "-3", 0.5 + 0.3 + 0.2 * 1 / 2),
    ],
)
def test_arithmetic_reward(response, answer, expected):
    r = arithmetic_reward(response, answer)
    assert r == pytest.approx(expected)
    assert 0.0 <= r <= 1.0


def test_reward_ordering_gives_a_learnable_signal():
    # correct+terse > correct+verbose > close > far > digits-free
    vals = [arithmetic_reward(r, "37") for r in ("37", "12 + 25 = 37", "36", "5", "hello")]
    assert vals == sorted(vals, reverse=True) and len(set(vals)) == len(vals)


def test_text_match_and_default_reward():
    assert text_match_reward("Paris.", "paris") == 1.0
    assert text_match_reward("It is Paris", "Paris") == pytest.approx(0.5 + 0.5 * 5 / 11)
    assert text_match_reward("new york city", "york") > 0.5
    assert text_match_reward("the city of light", "light city") == pytest.approx(0.5 * (2 * 0.5 * 1.0 / 1.5))
    assert text_match_reward("nothing", "Paris") == 0.0
    assert default_reward("5", "5") == 1.0 and default_reward("Paris", "Paris") == 1.0
    assert compute_rewards(["5", "x"], ["5", "5"]) == [1.0, 0.0]
    with pytest.raises(ValueError):
        compute_rewards(["a"], ["a", "b"])


# ----------------------------------------------------------------------------------------- advantages


def test_grpo_advantages():
    r = [1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 2.0, 4.0]
    adv = grpo_advantages(r, group_size=2, eps=0.0 + 1e-6)
    s = math.sqrt(0.5)  # unbiased std of {1, 0}
    expected = [0.5 / s, -0.5 / s, 0.0, 0.0, 0.0, 0.0, -1 / math.sqrt(2), 1 / math.sqrt(2)]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)
    assert adv.dtype == torch.float32 and adv.shape == (8,)
    # groups sum to zero; equal-reward groups are exactly 0 (eps keeps it finite)
    assert torch.allclose(adv.view(-1, 2).sum(1), torch.zeros(4), atol=1e-6)
    assert torch.equal(grpo_advantages([3.0, 3.0, 3.0], 3), torch.zeros(3))
    # mean-only variant
    assert torch.allclose(grpo_advantages([1.0, 0.0, 2.0, 2.0], 2, normalize_std=False),
                          torch.tensor([0.5, -0.5, 0.0, 0.0]))
    with pytest.raises(ValueError):
        grpo_advantages([1.0, 2.0, 3.0], 2)


def test_grpo_eps_bounds_tiny_std():
    adv = grpo_advantages([0.0, 1e-9], 2, eps=1e-6)
    assert adv.abs().max() < 1e-3


def test_token_level_advantages():
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    out = token_level_advantages(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]))


# ---------------------------------------------------------------------------------------------- loss


def test_token_logprobs():
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert torch.allclose(lp, torch.tensor([[math.log(0.5), 2 - math.log(math.exp(2) + 1)]]))
    lp_t = token_logprobs(logits, torch.tensor([[1, 0]]), temperature=2.0)
    assert torch.allclose(lp_t[0, 1], torch.tensor(1 - math.log(math.e + 1)))


def test_policy_gradient_loss_on_policy_matches_reinforce():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.5, -0.5])
    lp = token_logprobs(logits, targets)
    loss, m = policy_gradient_loss(lp, lp.detach(), adv, mask, eps_clip=0.2)
    # on-policy: ratio = 1, loss value = -mean(A) over tokens, gradient = REINFORCE gradient
    assert loss.item() == pytest.approx(-(1.5 * 2 - 0.5 * 2) / 4)
    assert m["clipfrac"].item() == 0.0 and m["ratio_mean"].item() == pytest.approx(1.0)
    assert m["num_tokens"].item() == 4
    (g,) = torch.autograd.grad(loss, logits)
    lp2 = token_logprobs(logits, targets)
    ref = -(lp2 * adv.view(-1, 1) * mask).sum() / mask.sum()
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert torch.allclose(g, g_ref, atol=1e-6)
    # masked tokens get no gradient
    assert torch.all(g[0, 0] == 0) and torch.all(g[1, 2] == 0)


def test_policy_gradient_loss_clipping():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.9, 0.1]])).requires_grad_(True)  # ratios 1.8, 0.2
    mask = torch.ones(1, 2)
    adv = torch.tensor([[1.0, 1.0]])
    loss, m = policy_gradient_loss(new, old, adv, mask, eps_clip=0.2)
    # token 0: min(1.8, 1.2) = 1.2 (clipped, no grad); token 1: min(0.2, 0.8) = 0.2 (unclipped)
    assert loss.item() == pytest.approx(-(1.2 + 0.2) / 2)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    (g,) = torch.autograd.grad(loss, new)
    assert g[0, 0].item() == 0.0 and g[0, 1].item() == pytest.approx(-0.2 / 2)
    # asymmetric upper clip and negative advantages
    loss_hi, _ = policy_gradient_loss(new.detach(), old, adv, mask, eps_clip=0.2, eps_clip_high=1.0)
    assert loss_hi.item() == pytest.approx(-(1.8 + 0.2) / 2)
    loss_neg, _ = policy_gradient_loss(new.detach(), old, -adv, mask, eps_clip=0.2)
    assert loss_neg.item() == pytest.approx((1.8 + 0.8) / 2)  # max(ratio, clip) * |A| for A < 0


def test_policy_gradient_loss_micro_batches_sum_to_batch_mean():
    torch.manual_seed(1)
    lp = torch.randn(4, 6)
    old = lp + 0.05 * torch.randn(4, 6)
    adv = torch.randn(4)
    mask = (torch.rand(4, 6) > 0.3).float()
    full, _ = policy_gradient_loss(lp, old, adv, mask)
    n = mask.sum()
    parts = sum(policy_gradient_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2],
                                     num_tokens=n)[0] for i in (0, 2))
    assert torch.allclose(full, parts, atol=1e-6)


def test_collate_samples_alignment():
    S = types.SimpleNamespace
    samples = [
        S(prompt_ids=[5, 6], response_ids=[7, 8, 2], response_logprobs=[-0.1, -0.2, -0.3], advantage=1.0),
        S(prompt_ids=[9], response_ids=[4], response_logprobs=[-0.5], advantage=-2.0),
    ]
    b = collate_samples(samples, pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 2], [9, 4, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # targets = input_ids[:, 1:] = [[6, 7, 8, 2], [4, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert torch.allclose(b["rollout_logprobs"], torch.tensor([[0, -0.1, -0.2, -0.3], [-0.5, 0, 0, 0]]))
    assert b["advantages"].tolist() == [[0, 1, 1, 1], [-2, 0, 0, 0]]
    with pytest.raises(ValueError, match="log-probs"):
        collate_samples([S(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[0.0], advantage=0.0)], 0)
