"""Scored groups that learners share through their bucket (diloco.rollouts; rlvr/run/shared_rollouts.py).

Layout under the job's bucket, one version per learner and step, written as adapters are (payload first, manifest
last: rlvr/store/bucket.py)::

    rollouts/learner-0001/v00000012/adapter_model.safetensors   the tensors below
    rollouts/learner-0001/v00000012/adapter_config.json         {"step", "learner", "version", "group_size", "round"}
    rollouts/learner-0001/v00000012/manifest.json

The tensors of B groups of G completions, T the longest completion (no prompt: a receiver rebuilds it from its own
copy of the row):

    row_ids         [B]       int64    each group's prompt: its index in the task's training rows
    completion_ids  [B*G, T]  int32    right-padded with 0
    lengths         [B*G]     int32    tokens of each completion (1..T)
    (B = 0: the learner had no informative group this step; it still publishes, so nobody waits for it)
    behaviour_logp  [B*G, T]  float32  the sampling policy's log-prob of each token, 0 on padding
    rewards         [B*G]     float32  the sender's reward of each completion: compared, never used

About 8 bytes a token. What a reader trusts: nothing. ``read`` refuses (``RefusedGroups``) anything but exactly
these tensors at these dtypes and consistent shapes, more groups than ``GroupLimits.max_groups``, another group
size, a completion longer than ``max_tokens``, a token id outside the vocabulary, a log-prob that is not finite or
is above 0, a row id outside the rows or repeated, and a record that is not this learner's and step's; the files go
through AdapterBucket's checks (a manifest naming exactly the two files, sizes bounded before reading, SHA-256,
regular files inside the bucket only). Which rows a peer may send, what its completions are worth and how much
its log-probs may weigh are the receiver's to decide (rlvr/run/shared_rollouts.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from rlvr.store.bucket import MANIFEST, AdapterBucket, ManifestError, TornVersionError

TENSORS, RECORD = "adapter_model.safetensors", "adapter_config.json"
FIELDS = {"row_ids": torch.int64, "completion_ids": torch.int32, "lengths": torch.int32,
          "behaviour_logp": torch.float32, "rewards": torch.float32}
MAX_RECORD_BYTES = 4096


class RefusedGroups(ValueError):
    """A peer's groups that are not what a learner of this job writes; never trained on."""


class NotPublished(RefusedGroups):
    """A peer's step whose manifest (written last) is not there: not published, or still being written."""


@dataclass(frozen=True)
class GroupLimits:
    """What a receiver accepts from one peer for one step."""

    max_groups: int  # groups in one file
    group_size: int  # G, the receiver's own
    max_tokens: int  # the longest completion (rollout.max_new_tokens)
    vocab: int  # token ids must be below this (the model's embedding rows)
    rows: int  # row ids must be below this (the task's training rows)

    def max_bytes(self) -> int:
        """An upper bound on an honest file: the tensors at their widest plus safetensors' header."""
        n = self.max_groups * self.group_size
        return self.max_groups * 8 + n * (self.max_tokens * 8 + 12) + 4096


@dataclass
class SharedGroups:
    """One learner's shared groups of one step (see the module docstring for the shapes)."""

    learner: int
    step: int
    version: int  # optimizer steps the sampling policy had taken
    group_size: int  # G
    row_ids: torch.Tensor  # [B] int64
    completion_ids: torch.Tensor  # [B*G, T] int32
    lengths: torch.Tensor  # [B*G] int32
    behaviour_logp: torch.Tensor  # [B*G, T] float32
    rewards: torch.Tensor  # [B*G] float32
    round: int = 0  # the DiLoCo round of the weights that sampled them (0: no weight rounds; an older writer)

    @property
    def num_groups(self) -> int:
        return int(self.row_ids.numel())

    @property
    def mask(self) -> torch.Tensor:
        """[B*G, T] bool: the completions' tokens."""
        return torch.arange(self.completion_ids.shape[1], device="cpu")[None, :] < self.lengths[:, None]


class GroupBucket:
    """The shared groups of one job (``{url}/rollouts``), as learner ``learner`` of ``learners`` sees them."""

    def __init__(self, url: str, learner: int, learners: int):
        self.url, self.learner, self.learners = f"{str(url).rstrip('/')}/rollouts", learner, learners
        # every path checked against the job's bucket root: a linked rollouts/ or learner-k/ is never followed
        self._buckets = [AdapterBucket(f"{self.url}/learner-{k:04d}", within=str(url).rstrip("/"))
                         for k in range(learners)]

    def publish(self, shared: SharedGroups) -> int:
        """Write this learner's groups of ``shared.step``; returns the bytes written."""
        tensors = {name: getattr(shared, name).to("cpu", dtype).contiguous() for name, dtype in FIELDS.items()}
        record = {"step": shared.step, "learner": self.learner, "version": shared.version,
                  "group_size": shared.group_size, "round": shared.round}
        files = {TENSORS: save(tensors), RECORD: json.dumps(record).encode()}
        return self._buckets[self.learner].publish_files(shared.step, files).bytes

    def published(self, k: int) -> list[int]:
        """The steps learner ``k`` has groups of in the bucket, ascending: one listing (a step listed may still be
        being written: its manifest comes last)."""
        return self._buckets[k]._directories()

    def arrived(self, step: int) -> list[int]:
        """Learners whose groups of ``step`` have a manifest (not yet checked), ascending."""
        fs = self._buckets[0].fs
        return [k for k, b in enumerate(self._buckets) if fs.exists(f"{b.root}/v{step:08d}/{MANIFEST}")]

    def gc(self, keep: int) -> None:
        """Remove this learner's versions but the newest ``keep``."""
        self._buckets[self.learner].gc(keep)

    def read(self, k: int, step: int, limits: GroupLimits) -> tuple[SharedGroups, int]:
        """Learner ``k``'s groups of ``step``, checked against ``limits``, and the bytes read; RefusedGroups
        otherwise."""
        where = f"learner {k}'s groups of step {step}"
        try:
            files = self._buckets[k].read(step, {TENSORS: limits.max_bytes(), RECORD: MAX_RECORD_BYTES})
        except FileNotFoundError:  # no manifest (AdapterBucket.read): a missing file of a listed one is torn
            raise NotPublished(f"{where}: not published ({self._buckets[k].version_url(step)}: no manifest)") from None
        except (ManifestError, TornVersionError, OSError) as err:
            raise RefusedGroups(f"{where}: {err}") from None
        try:
            record = json.loads(files[RECORD])
            tensors = load(files[TENSORS])
        except (ValueError, SafetensorError, RuntimeError):
            raise RefusedGroups(f"{where}: not the record and tensors rlvr writes") from None
        if not (isinstance(record, dict) and record.get("step") == step and record.get("learner") == k
                and type(record.get("version")) is int and 0 <= record["version"] <= step
                and record.get("group_size") == limits.group_size
                and type(record.get("round", 0)) is int and 0 <= record.get("round", 0) < 1 << 31):
            raise RefusedGroups(f"{where}: its record is not this job's (step, learner, version <= step, group size "
                                f"{limits.group_size}, a round >= 0)")
        shared = SharedGroups(k, step, record["version"], limits.group_size, **_checked(tensors, limits, where),
                              round=record.get("round", 0))
        return shared, sum(len(d) for d in files.values())


def _checked(tensors: dict[str, torch.Tensor], limits: GroupLimits, where: str) -> dict[str, torch.Tensor]:
    """The tensors, if they are what ``limits`` allows (padding zeroed); RefusedGroups naming the first thing that
    is not."""
    if tensors.keys() != FIELDS.keys():
        raise RefusedGroups(f"{where}: tensors {sorted(tensors)[:8]}, not {sorted(FIELDS)}")
    for name, dtype in FIELDS.items():
        if tensors[name].dtype != dtype:
            raise RefusedGroups(f"{where}: {name} is {tensors[name].dtype}, not {dtype}")
    rows, ids, lengths = tensors["row_ids"], tensors["completion_ids"], tensors["lengths"]
    logp, rewards = tensors["behaviour_logp"], tensors["rewards"]
    B, G = rows.numel(), limits.group_size
    n, T = (ids.shape[0], ids.shape[1]) if ids.dim() == 2 else (-1, -1)
    if not (rows.dim() == 1 and B <= limits.max_groups and n == B * G and (1 <= T or B == 0)
            and T <= limits.max_tokens and logp.shape == ids.shape and lengths.shape == rewards.shape == (n,)):
        raise RefusedGroups(f"{where}: shapes are not B groups of {G} (B <= {limits.max_groups}) of at most "
                            f"{limits.max_tokens} tokens")
    if not (bool((rows >= 0).all()) and bool((rows < limits.rows).all()) and rows.unique().numel() == B):
        raise RefusedGroups(f"{where}: a row id outside the task's {limits.rows} training rows, or repeated")
    if not (bool((lengths >= 1).all()) and bool((lengths <= T).all())):
        raise RefusedGroups(f"{where}: a completion length outside 1..{T}")
    mask = torch.arange(T, device="cpu")[None, :] < lengths[:, None]  # [n, T]
    ids, logp = ids.masked_fill(~mask, 0), logp.masked_fill(~mask, 0.0)
    if not (bool((ids >= 0).all()) and bool((ids < limits.vocab).all())):
        raise RefusedGroups(f"{where}: a token id outside the vocabulary of {limits.vocab}")
    if not (bool(torch.isfinite(logp).all()) and bool((logp <= 0).all())):
        raise RefusedGroups(f"{where}: a log-prob that is not finite or is above 0")
    return {"row_ids": rows, "completion_ids": ids, "lengths": lengths, "behaviour_logp": logp, "rewards": rewards}
