"""TRL's ``GRPOTrainer(environment_factory=...)`` training against ``stadium serve wordguess``.

``python trl_grpo_environment_factory.py ENV_URL`` (``make trainers`` runs it). No weights
can be downloaded here, so the policy is a tiny Qwen3 built from a config with random
weights, a byte-level tokenizer trained on the spot, and TRL's own Qwen3 chat template. A
random model never writes a tool call, so its logits are steered (a constant added, the
gradient untouched) to reply with one scripted tool call per turn: ``guess`` with the next
word of a list. Everything else is TRL's: generation, tool-call parsing, the environment
pool (sessions reused across batches), rewards from ``get_reward``, GRPO steps.

Checks, and exits non-zero otherwise: tool calls reached the server; each training step's
reward as TRL logged it is the mean of that step's episodes' rewards; and every episode's
rewards are those of the same guesses replayed in-process on Stadium's ``WordGuessEnv``
under the same seed (so they came from the server's env). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from datasets import Dataset
from openenv import GenericEnvClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_chat_template

ENV_URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
GUESSES = ["crane", "apple", "grape"]
EPISODES: list[dict[str, Any]] = []


class WordGuess:
    """One OpenEnv session on Stadium per instance; TRL pools and resets them."""

    def __init__(self) -> None:
        self.client = GenericEnvClient(base_url=ENV_URL).sync()
        self.client.connect()
        self.reward = 0.0
        self.episode: dict[str, Any] = {}

    def reset(self, **kwargs: Any) -> str:
        result = self.client.reset(seed=int(kwargs.get("seed", 0)))
        self.reward = 0.0
        self.episode = {"seed": int(kwargs.get("seed", 0)), "words": [], "rewards": []}
        EPISODES.append(self.episode)
        return str(result.observation["prompt"])

    def guess(self, word: str) -> str:
        """Guess the secret five-letter word.

        Args:
            word: a five-letter word

        Returns:
            The feedback: G right place, Y elsewhere in the word, . absent.
        """
        result = self.client.step({"word": word})
        self.reward += result.reward or 0.0
        self.episode["words"].append(word)
        self.episode["rewards"].append(result.reward or 0.0)
        return str(result.observation["feedback"])

    def get_reward(self) -> float:
        return self.reward


def build_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                "<tool_response>", "</tool_response>", "<think>", "</think>"]  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"name": "guess", "arguments": {"word": w}}) for w in GUESSES] * 4
    corpus += ["Guess the secret five-letter word. user assistant system tool"]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )  # fmt: skip
    fast.chat_template = qwen3_chat_template
    fast.padding_side = "left"
    return fast


class Scripted(Qwen3ForCausalLM):
    """A random tiny Qwen3 whose logits are pushed toward a scripted reply per turn."""

    script: list[list[int]] = []
    turn_start = 0  # <|im_start|>
    assistant_id = 0  # the first token of "assistant"
    prefix_len = 0  # <|im_start|>assistant\n, in tokens

    def forward(self, input_ids: torch.LongTensor | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        out = super().forward(input_ids=input_ids, **kwargs)
        if input_ids is None or not self.script:
            return out
        for row in range(input_ids.shape[0]):
            ids = input_ids[row].tolist()
            starts = [i for i in range(len(ids) - 1) if ids[i] == self.turn_start]
            if not starts:
                continue
            turn = sum(1 for i in starts if ids[i + 1] == self.assistant_id) - 1
            done = len(ids) - (starts[-1] + self.prefix_len)
            target = self.script[min(max(turn, 0), len(self.script) - 1)]
            if 0 <= done < len(target):
                out.logits[row, -1, target[done]] += 1e4
        return out


def main() -> None:
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Scripted(config)
    Scripted.turn_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    Scripted.assistant_id = tokenizer.encode("assistant")[0]
    Scripted.prefix_len = len(tokenizer.encode("<|im_start|>assistant\n"))
    calls = [json.dumps({"name": "guess", "arguments": {"word": w}}) for w in GUESSES]
    # Each reply, without the leading newline's token: the model writes from after it.
    Scripted.script = [
        tokenizer.encode(f"\n<tool_call>\n{call}\n</tool_call><|im_end|>")[1:] for call in calls
    ]
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "Play wordguess."}], "seed": s}
            for s in (1, 2, 3, 4)
        ]
    )
    args = GRPOConfig(
        output_dir="/tmp/stadium-trl-grpo", max_steps=2, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=256, max_tool_calling_iterations=3,
        learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True,
        generation_kwargs={"use_cache": False}, save_strategy="no",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, args=args, train_dataset=dataset,
        environment_factory=WordGuess,
    )  # fmt: skip
    trainer.train()
    logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    check(logged, args.per_device_train_batch_size)
    print(json.dumps({"logged_rewards": logged, "episodes": EPISODES}))


def check(logged: list[float], per_step: int) -> None:
    from stadium.envs.wordguess import Guess, WordGuessEnv

    played = [e for e in EPISODES if e["words"]]
    assert played, "no tool call reached the server"
    for episode in EPISODES:
        env = WordGuessEnv()
        env.reset(seed=episode["seed"])
        replay = [env.step(Guess(w)).reward or 0.0 for w in episode["words"]]
        assert pytest_approx(replay) == pytest_approx(episode["rewards"]), (episode, replay)
    # The probe instance's reset is not an episode: the last per_step * steps ones are.
    episodes = EPISODES[-per_step * len(logged) :]
    for step, mean in enumerate(logged):
        chunk = episodes[step * per_step : (step + 1) * per_step]
        expected = sum(sum(e["rewards"]) for e in chunk) / per_step
        assert abs(mean - expected) < 1e-5, (step, mean, expected)


def pytest_approx(values: list[float]) -> list[float]:
    return [round(v, 6) for v in values]


if __name__ == "__main__":
    main()
