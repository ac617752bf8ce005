"""RL pieces: prompt data, rule-based rewards, GRPO advantages, policy-gradient loss.

    from miles.rl import (make_prompt_source, encode_prompts, compute_rewards, grpo_advantages,
                          collate_samples, forward_logprobs, policy_gradient_loss)
"""

from miles.rl.advantages import grpo_advantages, token_level_advantages  # noqa: F401
from miles.rl.data import (  # noqa: F401
    PromptDataError,
    PromptItem,
    PromptSource,
    arithmetic_task,
    encode_prompts,
    format_prompt,
    load_prompt_data,
    make_prompt_source,
)
from miles.rl.loss import collate_samples, forward_logprobs, policy_gradient_loss, token_logprobs  # noqa: F401
from miles.rl.rewards import arithmetic_reward, compute_rewards, default_reward, text_match_reward  # noqa: F401
