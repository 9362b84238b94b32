"""Output processing: each user request's group of sequences (n > 1, or a
fork's child), their completions, incremental detokenizers and stop
strings, turned into RequestOutputs after every step; the latency samples
of the requests that finished. The engine feeds it the step's sampled
sequences (process) and forgets a group it aborts (release)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from trajserve.request import Request, RequestStatus
from trajserve.model.tokenizer import IncrementalDetokenizer
from trajserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass(slots=True)
class RequestGroup:
    """One user request: n sequences over the same prompt."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    completions: list[CompletionOutput]
    arrival_time: float
    stop_scan: list[int] = field(default_factory=list)  # text length already scanned for stops
    detoks: list[IncrementalDetokenizer] = field(default_factory=list)  # one per completion


class OutputProcessor:
    def __init__(self, finish_stopped: Callable[[Request], None], release_seq: Callable[[str], None]) -> None:
        """finish_stopped(seq): the scheduler ends seq on a stop string;
        release_seq(seq id): the sampler forgets it."""
        self._finish_stopped, self._release_seq = finish_stopped, release_seq
        self.groups: dict[str, RequestGroup] = {}
        self.seq_to_group: dict[str, tuple[RequestGroup, int]] = {}
        self.ttfts: deque[float] = deque(maxlen=10_000)  # of finished requests, for metrics()
        self.itls: deque[float] = deque(maxlen=100_000)

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for i, seq in enumerate(group.seqs):
            self.seq_to_group[seq.request_id] = (group, i)

    def process(self, seq_ids: list[str], logprobs: list, now: float,
                accepted_logprobs: dict[str, list] | None = None) -> list[RequestOutput]:
        """The step's new tokens (and logprobs) into each touched request's
        completions; its RequestOutput, the finished ones forgotten.
        accepted_logprobs: speculation's, for the accepted draft tokens that
        came before each sequence's sampled one."""
        touched: dict[str, RequestGroup] = {}
        for rid in seq_ids:
            group = self.seq_to_group[rid][0]
            if group.request_id not in touched:
                touched[group.request_id] = group
                # A completion this step did not advance (finished, or
                # preempted) must not repeat its last delta to a stream.
                for c in group.completions:
                    c.delta_text, c.delta_token_ids = "", []
        for rid, lp in zip(seq_ids, logprobs):
            group, i = self.seq_to_group[rid]
            seq = group.seqs[i]
            comp = group.completions[i]
            new_ids = seq.output_token_ids[len(comp.token_ids):]
            comp.delta_token_ids = new_ids
            comp.token_ids = comp.token_ids + new_ids
            if lp is not None:
                lps = [lp] if accepted_logprobs is None else accepted_logprobs.get(rid, []) + [lp]
                comp.logprobs = (comp.logprobs or []) + lps[:len(new_ids)]  # fewer: a stop inside them
            self._detokenize(group, i)
            if seq.status.finished and comp.finish_reason is None:
                comp.finish_reason = seq.status.value
                comp.stop_reason = seq.stop_reason
        outs = []
        for group in touched.values():
            finished = all(c.finish_reason is not None for c in group.completions)
            outs.append(self.output(group, finished, now))
            if finished:
                self._record_latency(group)
                self.groups.pop(group.request_id, None)
                for s in group.seqs:
                    self.release(s)
        return outs

    def _detokenize(self, group: RequestGroup, i: int) -> None:
        """Update text and delta; finish on a stop string."""
        comp, seq = group.completions[i], group.seqs[i]
        sp = seq.sampling_params
        # Decodes only the new ids (plus a small window); a split multi-byte
        # character is held back until it completes or the sequence ends.
        detok = group.detoks[i]
        new = comp.delta_token_ids
        if sp.stop and len(new) > 1:
            # Speculation appended several tokens: scan after each, as steps
            # of one token would, so the sequence ends at the token that
            # completes a stop string, not at the accepted ones behind it.
            for j, t in enumerate(new):
                detok.step(t)
                if j < len(new) - 1 and _stop_hits(detok.text, sp.stop, group.stop_scan[i]):
                    _drop_last(seq, comp, len(new) - j - 1)
                    break
        else:
            detok.extend(new)
        if seq.status.finished:
            detok.flush()
        text = detok.text
        if sp.stop:
            hits = _stop_hits(text, sp.stop, group.stop_scan[i])
            if hits:
                pos, s = min(hits)
                text = text[: pos + len(s)] if sp.include_stop_str_in_output else text[:pos]
                if not seq.status.finished:
                    self._finish_stopped(seq)
                seq.status = RequestStatus.FINISHED_STOPPED
                seq.stop_reason = s
            group.stop_scan[i] = len(text)
            if not seq.status.finished:
                # Streamed text cannot be taken back: hold a tail that may be
                # the start of a stop string completed by a later token.
                hold = max(map(len, sp.stop)) - 1
                text = text[: max(len(comp.text), len(text) - hold)]
        comp.delta_text = text[len(comp.text):] if text.startswith(comp.text) else text
        comp.text = text

    def output(self, group: RequestGroup, finished: bool, now: float) -> RequestOutput:
        first = min((s.first_token_time for s in group.seqs if s.first_token_time is not None), default=None)
        metrics = RequestMetrics(
            arrival_time=group.arrival_time, first_token_time=first,
            finished_time=now if finished else None,
            ttft=None if first is None else first - group.arrival_time,
            inter_token_times=[t for s in group.seqs for t in s.inter_token_times],
            num_preemptions=sum(s.num_preemptions for s in group.seqs),
            num_draft_tokens=sum(s.num_draft_tokens for s in group.seqs),
            num_accepted_tokens=sum(s.num_accepted_draft_tokens for s in group.seqs))
        comps = [CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                  c.logprobs, c.delta_text, list(c.delta_token_ids))
                 for c in group.completions]
        # Not copied each step: the list is complete by the first output (the
        # first sampled token), and nothing writes it after that -- nor after
        # an abort's output, which is the request's last.
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, comps, finished, metrics,
                             num_cached_tokens=max(s.num_cached_tokens for s in group.seqs),
                             prompt_logprobs=group.seqs[0].prompt_logprobs)

    def _record_latency(self, group: RequestGroup) -> None:
        first = min((s.first_token_time for s in group.seqs if s.first_token_time is not None), default=None)
        if first is not None:
            self.ttfts.append(first - group.arrival_time)
        for s in group.seqs:
            self.itls.extend(s.inter_token_times)

    def release(self, seq: Request) -> None:
        """seq is done with: forgotten here and by the sampler (its seeded stream)."""
        self.seq_to_group.pop(seq.request_id, None)
        self._release_seq(seq.request_id)


def _stop_hits(text: str, stops: list[str], scanned: int) -> list[tuple[int, str]]:
    """(position, stop) of each stop string in text; only text added since
    `scanned` (plus an overlap) can hold a new one."""
    start = max(0, scanned - max(map(len, stops)) + 1)
    hits = [(text.find(s, start), s) for s in stops]
    return [(pos, s) for pos, s in hits if pos >= 0]


def _drop_last(seq: Request, comp: CompletionOutput, n: int) -> None:
    """The last n tokens of seq were appended after a stop string completed
    (accepted drafts of the same step): they are not part of the output."""
    del seq.all_token_ids[-n:]
    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
    comp.token_ids = comp.token_ids[:-n]
    comp.delta_token_ids = comp.delta_token_ids[:-n]
    if comp.logprobs is not None:
        comp.logprobs = comp.logprobs[:-n]
