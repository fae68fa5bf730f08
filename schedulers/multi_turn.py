"""MultiTurnRollout: the model and an environment take turns (`rewards.<domain>.rollout: {type: multi_turn, ...}`).

Each response of a group is a trajectory with an environment of its own (roll_core/environment.py; the built-in
`python` runs the code sandbox). A turn is one generation request to actor_infer for every trajectory still going,
from its whole context as token ids (the prompt, the earlier turns as sampled, the tools' answers as encoded); it
ends at a stop string (the call's closing tag, rollout.stop), at the end of the answer, or at the token budget. The
environment then reads the turn: a tool call gets its answer appended (through the chat template, or inline;
schedulers/trajectory.py) and the trajectory goes on; anything else is the final answer. After `max_turns` model
turns, or when the response reaches `max_total_tokens`, the trajectory ends as it stands.

The group comes out as one generation output, as actor_infer's: response_ids with the model's tokens in
response_mask and the tools' in tool_mask, the sampled tokens' log-probs, and the trajectories themselves. The
reward worker scores each final answer with the whole trajectory as the row's `trajectory` column (chat messages),
so a plugin can judge the tool use too. An environment whose infrastructure fails (EnvironmentUnavailable) ends
its trajectory, and the sample is masked (`error`), never scored.

With `deterministic: true` each turn's request gets a seed made from the request's and the turn's number.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import zlib
from typing import Any

from roll_core.config import GeneratingArgs
from roll_core.environment import Environment, EnvironmentUnavailable, EnvStep
from roll_core.registry import ROLLOUTS
from roll_core.rewards.scored import MASK_ERROR, ScoredSample
from schedulers.rollout import Request, SingleTurnRollout
from schedulers.trajectory import Trajectory, tool_answer_ids, trajectory_rows

__all__ = ["ROLLOUTS", "MultiTurnRollout"]

logger = logging.getLogger(__name__)


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of a request's `turn`-th generation (the first keeps the request's own): fixed by the request's
    seed and the turn alone, so a resumed deterministic run samples the same turns."""
    if seed is None or turn == 0:
        return seed
    return zlib.crc32(f"{seed}/turn{turn}".encode())


@ROLLOUTS.register("multi_turn", environment=True)
class MultiTurnRollout(SingleTurnRollout):
    """A group is one trajectory per response, the model and the domain's environment taking turns."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from workers.environments.registry import get_environment_cls

        self.environment_cls = get_environment_cls(self.config.environment)
        self.live: dict[str, tuple[int, str]] = {}
        """A request's id -> (worker, id) of its turn now generating, for abort."""

    def environment(self, row: dict[str, Any]) -> Environment:
        env = self.environment_cls(**self.config.environment_options)
        env.reset(row)
        return env

    async def sample(
        self, worker: int, request_id: str, rows: list[dict[str, Any]], prompts: list[list[int]],
        args: GeneratingArgs, n: int, seed: int | None, stats: Any, wave: tuple[str, str, int] | None = None,
    ) -> dict | None:
        trajectories = [Trajectory(list(prompt)) for prompt in prompts for _ in range(n)]
        envs = [self.environment(row) for row in rows for _ in range(n)]
        failed: list[str | None] = [None] * len(trajectories)
        total = self.config.max_total_tokens or args.max_new_tokens * self.config.max_turns
        turn_args = dataclasses.replace(args, stop=tuple(self.config.stop))
        live, with_log_probs = list(range(len(trajectories))), False
        try:
            for turn in range(self.config.max_turns):
                left = {i: total - len(trajectories[i].tokens) for i in live}
                budget = min(args.max_new_tokens, max(left.values()))
                output = await self.turn(
                    worker, request_id, turn, [trajectories[i] for i in live], prompts, n,
                    dataclasses.replace(turn_args, max_new_tokens=budget), seed, stats, wave,
                )
                if output is None:
                    return None
                with_log_probs = "infer_log_probs" in output
                texts = self.add_turns(output, [trajectories[i] for i in live], [left[i] for i in live])
                if turn == self.config.max_turns - 1:
                    break
                live = await self.answer(live, texts, trajectories, envs, failed, total)
                if not live:
                    break
        finally:
            self.live.pop(request_id, None)
            for env in envs:
                env.close()
        out = trajectory_rows(trajectories, self.tokenizer.pad_token_id, with_log_probs)
        return {**out, "trajectories": trajectories, "environment_failure": failed}

    async def turn(
        self, worker: int, request_id: str, turn: int, going: list[Trajectory], prompts: list[list[int]], n: int,
        args: GeneratingArgs, seed: int | None, stats: Any, wave: tuple[str, str, int] | None = None,
    ) -> dict | None:
        """One turn's generation: the first from the prompts (n samples each, one of the requests of `wave`), the
        later ones from each trajectory's context (one sample each)."""
        turn_id = request_id if turn == 0 else f"{request_id}/turn{turn}"
        self.live[request_id] = (worker, turn_id)
        if turn == 0:
            return await self.infer.generate(worker, turn_id, prompts, args, n, seed, stats, wave)
        contexts = [t.context() for t in going]
        return await self.infer.generate(worker, turn_id, contexts, args, 1, turn_seed(seed, turn), stats)

    def add_turns(self, output: dict[str, Any], going: list[Trajectory], left: list[int]) -> list[str]:
        """Each trajectory's new turn, as sampled, cut at what is left of its token budget; the turns' texts."""
        texts = []
        for row, (t, budget) in enumerate(zip(going, left, strict=True)):
            kept = output["response_mask"][row] > 0
            ids = output["response_ids"][row][kept].tolist()
            log_probs = output["infer_log_probs"][row][kept].tolist() if "infer_log_probs" in output else None
            versions = output["token_versions"][row][kept].tolist() if "token_versions" in output else None
            finish = output["finish_reason"][row]
            if len(ids) > budget:
                ids, finish = ids[:budget], "length"
                log_probs = log_probs[:budget] if log_probs is not None else None
                versions = versions[:budget] if versions is not None else None
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            t.add_turn(ids, log_probs, text, finish, versions)
            texts.append(text)
        return texts

    async def answer(
        self, live: list[int], texts: list[str], trajectories: list[Trajectory], envs: list[Environment],
        failed: list[str | None], total: int,
    ) -> list[int]:
        """The environments read the turns (at once, each in a thread); a tool call's answer is appended.
        Returns the trajectories that go on."""
        steps = await asyncio.gather(
            *(asyncio.to_thread(envs[i].step, text) for i, text in zip(live, texts, strict=True)),
            return_exceptions=True,
        )
        going = []
        for i, step in zip(live, steps, strict=True):
            if isinstance(step, EnvironmentUnavailable):
                failed[i] = str(step)
                continue
            if isinstance(step, BaseException):
                raise step
            assert isinstance(step, EnvStep)
            t = trajectories[i]
            if step.done or t.finish == "length":
                continue
            ids, text = tool_answer_ids(
                self.tokenizer, step.observation, self.config.tool_message, self.config.max_tool_output_tokens
            )
            room = total - len(t.tokens)
            t.add_tool(ids[:room], text, step)
            if len(ids) >= room:
                t.finish = "length"  # no room left for another turn
                continue
            going.append(i)
        return going

    async def abort(self, requests: list[Request]) -> None:
        await self.infer.abort([self.live.get(r.id, (r.worker, r.id)) for r in requests])

    def decode(self, output: dict[str, Any]) -> list[str]:
        """What the reward judges: each trajectory's final answer."""
        return [t.final_answer() for t in output["trajectories"]]

    def reward_rows(self, row: dict[str, Any], output: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**row, "trajectory": t.messages} for t in output["trajectories"]]

    def checked(self, output: dict[str, Any], results: list[ScoredSample]) -> list[ScoredSample]:
        """A trajectory whose environment failed is masked: the infrastructure failed, not the policy."""
        results = list(results)
        for i, why in enumerate(output["environment_failure"]):
            if why is not None:
                logger.warning("domain %r: environment failed (%s); the trajectory is masked", self.domain, why)
                results[i] = ScoredSample.masked_as(MASK_ERROR)
        return results
