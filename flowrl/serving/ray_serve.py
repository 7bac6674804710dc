"""The Ray Serve backend of `flowrl serve-reward` (the `serve` extra: `pip install 'flowrl[serve]'`).

Each reward is one Serve application of `replicas` replicas (`gpus_per_replica` GPUs each, or a share of the CPUs).
A request's bytes go to a replica as they came; the replica decodes them and hands each sample to Serve's batching
(`serve.batch`), which gathers samples across concurrent requests into one forward of up to `max_batch_size` images,
waiting at most `batch_wait_ms` for it to fill. Samples of one shape are stacked; a forward that fails is retried
sample by sample, so one client's bad sample fails only its own request. The HTTP front (auth, size limits, request
ids: flowrl/serving/server.py) runs in the driver and calls the replicas through Serve's handles, with Serve's own HTTP
proxy off. A replica that dies mid-request (its actor killed, its node lost) costs that attempt only: the call is
sent again, `retries` times, to a live replica, and if none answers the client gets a 503 it retries.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import defaultdict
from typing import Any

import ray
import torch
from ray import serve
from ray.exceptions import RayActorError

from flowrl.registry import REWARDS
from flowrl.serving.server import MAX_DECODED_BYTES, Answer, Stats, decode_answer, score_answer

APP_PREFIX = "flowrl-reward-"


class RewardReplica:
    """One replica: the reward built from its registry name and settings on this replica's device."""

    def __init__(
        self,
        name: str,
        settings: dict[str, Any],
        device: str,
        dtype: str,
        max_batch_size: int,
        batch_wait_s: float,
        max_decoded_bytes: int,
    ):
        if device == "cpu":  # Ray gives an actor OMP_NUM_THREADS = its CPUs; torch follows it
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
        self.name, self.max_decoded_bytes = name, max_decoded_bytes
        self.reward = REWARDS.get(name)(device=device, dtype=getattr(torch, dtype), **settings)
        self._score_samples.set_max_batch_size(max_batch_size)
        self._score_samples.set_batch_wait_timeout_s(batch_wait_s)
        self.lock = threading.Lock()  # one forward at a time, whatever thread runs it

    async def score(self, raw: bytes, content_type: str, content_encoding: str) -> Answer:
        decoded = decode_answer(self.name, raw, content_type, content_encoding, self.max_decoded_bytes)
        if isinstance(decoded[0], int):
            return decoded
        images, prompts, metadata = decoded
        answers = await asyncio.gather(
            *(self._score_samples((images[i], prompts[i], metadata[i])) for i in range(len(prompts)))
        )
        failed = next((answer for answer in answers if answer[0] != 200), None)
        if failed is not None:
            return failed
        parts = {key: [answer[1]["parts"][key][0] for answer in answers] for key in answers[0][1]["parts"]}
        scores = [answer[1]["scores"][0] for answer in answers]
        return 200, {"scores": scores, "parts": parts, "batch_images": max(a[1]["batch_images"] for a in answers)}

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _score_samples(self, samples: list[tuple[torch.Tensor, str, dict]]) -> list[Answer]:
        return await asyncio.to_thread(self._forward, samples)  # the event loop keeps taking requests meanwhile

    def _forward(self, samples: list[tuple[torch.Tensor, str, dict]]) -> list[Answer]:
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (pixels, _, _) in enumerate(samples):
            groups[tuple(pixels.shape)].append(i)
        answers: list[Answer] = [(500, {})] * len(samples)
        with self.lock:
            for indexes in groups.values():
                for chunk in ([indexes], [[i] for i in indexes]):  # the batch; sample by sample if the batch fails
                    for part in chunk:
                        answer = self._score(part, samples)
                        for j, i in enumerate(part):
                            answers[i] = _one(answer, j)
                    if all(answers[i][0] == 200 for i in indexes) or len(indexes) == 1:
                        break
        return answers

    def _score(self, part: list[int], samples: list[tuple[torch.Tensor, str, dict]]) -> Answer:
        images = torch.stack([samples[i][0] for i in part])
        status, payload = score_answer(
            self.name, self.reward, images, [samples[i][1] for i in part], [samples[i][2] for i in part]
        )
        return status, {**payload, "batch_images": len(part)} if status == 200 else payload


def _one(answer: Answer, j: int) -> Answer:
    """Sample j's share of a batch's answer (an error: the whole error)."""
    status, payload = answer
    if status != 200:
        return answer
    parts = {k: [v[j]] for k, v in payload["parts"].items()}
    return 200, {"scores": [payload["scores"][j]], "parts": parts, "batch_images": payload["batch_images"]}


class RayBackend:
    """Serve applications for `rewards` ({name: settings}) on a local Ray (started here, stopped by close())."""

    def __init__(
        self,
        rewards: dict[str, dict[str, Any]],
        device: str | None = None,
        dtype: str = "float32",
        replicas: int = 1,
        gpus_per_replica: float = 0.0,
        cpus_per_replica: float = 1.0,
        max_batch_size: int = 16,
        batch_wait_ms: float = 10.0,
        max_decoded_bytes: int = MAX_DECODED_BYTES,
        retries: int = 2,
        timeout_s: float = 600.0,
        ray_init: dict[str, Any] | None = None,
    ):
        for field, value, low in (("replicas", replicas, 1), ("max_batch_size", max_batch_size, 1)):
            if int(value) < low:
                raise ValueError(f"--{field.replace('_', '-')} {value}: use {low} or more")
        if gpus_per_replica < 0 or cpus_per_replica <= 0 or batch_wait_ms < 0:
            raise ValueError(
                f"--gpus-per-replica {gpus_per_replica}, --cpus-per-replica {cpus_per_replica}, --batch-wait-ms "
                f"{batch_wait_ms}: use G >= 0, C > 0, W >= 0"
            )
        self.names, self.owns_cluster = list(rewards), True
        self.retries, self.timeout_s, self.stats = int(retries), float(timeout_s), Stats()
        device = device or ("cuda" if gpus_per_replica > 0 else "cpu")
        if device.startswith("cuda") and gpus_per_replica <= 0:
            raise ValueError(f"--device {device} needs --gpus-per-replica > 0 (each replica's GPU share)")
        # A new local Ray unless RAY_ADDRESS names a running cluster (then only this service's applications are
        # removed on close). On a new one: no idle task workers started ahead (the replicas are actors, each in its own
        # new process anyway), and replicas at the service's priority (Ray's default niceness 15 starves them beside
        # any busy process).
        self.owns_cluster = not os.environ.get("RAY_ADDRESS")
        settings = {"logging_level": "ERROR", "log_to_driver": False}
        if self.owns_cluster:
            settings.update(
                include_dashboard=False, _system_config={"prestart_worker_first_driver": False, "worker_niceness": 0}
            )
        ray.init(**{**settings, **(ray_init or {})})
        try:
            serve.start(proxy_location="Disabled")  # the front in flowrl/serving/server.py is the HTTP endpoint
            targets = []
            for name, settings in rewards.items():
                deployment = serve.deployment(RewardReplica).options(
                    name=name,
                    num_replicas=int(replicas),
                    ray_actor_options={"num_cpus": float(cpus_per_replica), "num_gpus": float(gpus_per_replica)},
                    max_ongoing_requests=256,  # requests wait inside the replica, in its batch queue
                )
                app = deployment.bind(
                    name, settings, device, dtype, int(max_batch_size), batch_wait_ms / 1000, max_decoded_bytes
                )
                quiet = {"log_level": "WARNING", "enable_access_log": False}
                targets.append(serve.RunTarget(app, name=APP_PREFIX + name, route_prefix=None, logging_config=quiet))
            handles = serve.run_many(targets)
        except Exception as err:
            self.close()
            raise RuntimeError(
                f"serve-reward: the replicas did not start: {' '.join(str(err).split())[-600:]}"
            ) from None
        self.handles = dict(zip(self.names, handles))
        self.address = ray.get_runtime_context().gcs_address

    def info(self, name: str) -> dict[str, Any]:
        return {"modalities": list(REWARDS.get(name).modalities), "differentiable": False}

    def score(self, name: str, raw: bytes, content_type: str, content_encoding: str) -> Answer:
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats.count("replica_retries")
            try:
                return tuple(
                    self.handles[name]
                    .score.remote(raw, content_type, content_encoding)
                    .result(timeout_s=self.timeout_s)
                )
            except RayActorError as err:  # the replica died or is unreachable: another one takes the request
                last = err
            except TimeoutError:
                return 504, {"error": f"reward {name}: no answer from its replica within {self.timeout_s:g}s"}
        return 503, {"error": f"reward {name}: its replica died ({type(last).__name__}); retry the request"}

    def replica_names(self, name: str) -> list[str]:
        """Actor names of reward `name`'s live replicas (for ray.get_actor(..., namespace="serve"))."""
        found = ray.util.list_named_actors(all_namespaces=True)
        prefix = f"SERVE_REPLICA::{APP_PREFIX}{name}#"
        return sorted(a["name"] for a in found if a["namespace"] == "serve" and a["name"].startswith(prefix))

    def close(self) -> None:
        """Serve and Ray stopped: no replica, raylet or GCS process left running."""
        if not ray.is_initialized():
            return
        try:
            if self.owns_cluster:
                serve.shutdown()
            else:
                for name in self.names:
                    serve.delete(APP_PREFIX + name)
        finally:
            ray.shutdown()
