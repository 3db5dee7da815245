"""The NIXL connector's scheduler side against a real Scheduler and BlockManager, with the
worker side played by hand (the StepResults a transport would produce): who waits for remote
K/V, which blocks a read fills, what a failed read does under each policy, and leases."""

from __future__ import annotations

import pytest

from stoker.core.block_manager import BlockManager
from stoker.core.scheduler import Scheduler, SchedulerOutput
from stoker.core.sequence import Sequence, SequenceStatus
from stoker.core.step import SampledTokens, StepResult
from stoker.kv_transfer import compat
from stoker.kv_transfer import params as kv_params
from stoker.kv_transfer.config import KVTransferConfig
from stoker.kv_transfer.metadata import ConnectorMeta, TransferReport
from stoker.kv_transfer.scheduler_side import NixlSchedulerConnector
from stoker.sampling_params import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(policy: str = "recompute", lease: float = 10.0, num_blocks: int = 16) -> tuple[Scheduler, NixlSchedulerConnector, Clock]:
    bm = BlockManager(num_blocks, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    clock = Clock()
    cfg = KVTransferConfig(kv_load_failure_policy=policy, engine_id="decode",
                           kv_connector_extra_config={"kv_lease_duration": lease, "side_channel_port": 5999})
    conn = NixlSchedulerConnector(cfg, bm, clock=clock)
    sched.kv_connector = conn
    return sched, conn, clock


def remote_seq(prompt: list[int], remote_blocks: list[int], rid: str = "d1") -> Sequence:
    p = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": remote_blocks,
         "remote_engine_id": "prefill", "remote_host": "localhost", "remote_port": 5600, "tp_size": 1,
         "remote_request_id": "p1"}
    return Sequence(rid, prompt, SamplingParams(temperature=0, max_tokens=4, kv_transfer_params=p))


def run_step(sched: Scheduler, plan: SchedulerOutput, token: int = 7, **result_kw: object) -> None:
    sampled = {s.seq.seq_id: SampledTokens([token], [0.0], [None]) for s in plan.scheduled if s.do_sample}
    sched.update_after_step(plan, StepResult(sampled, **result_kw))


def test_a_remote_prefill_waits_with_its_blocks_then_runs_its_last_token() -> None:
    sched, conn, _ = make()
    seq = remote_seq(list(range(10)), [5, 6, 7])  # 10 tokens: 3 blocks of 4
    sched.add(seq)
    plan = sched.schedule()
    assert plan.is_empty and seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV
    table = sched.block_manager.get_block_table(seq)
    assert len(table) == 3 and not sched.waiting and not sched.running
    meta = conn.build_connector_meta()
    assert isinstance(meta, ConnectorMeta) and len(meta.loads) == 1
    load = meta.loads[0]
    assert load.remote_block_ids == (5, 6, 7) and load.local_block_ids == tuple(table)
    assert load.remote_request_id == "p1" and conn.build_connector_meta() is None  # each read starts once
    assert sched.schedule().is_empty  # still waiting: never scheduled before its read arrives
    run_step(sched, SchedulerOutput(), finished_recving=frozenset({"d1"}),
             kv_connector_output=TransferReport(transfers={"d1": (0.01, 4096)}))
    assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 9
    plan = sched.schedule()
    (s,) = plan.scheduled
    assert s.start_pos == 9 and s.num_tokens == 1 and s.do_sample  # the last prompt token, for its logits
    assert s.block_table == table
    run_step(sched, plan)
    assert seq.output_token_ids == [7]
    assert conn.stats.external_prefix_cache_hits == 10 and conn.stats.xfer_time_seconds.count == 1
    assert conn.stats.bytes_transferred.total == 4096
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert sched.block_manager.num_free_blocks == 16
    sched.block_manager.check_integrity()


def test_a_local_prefix_hit_reads_only_the_rest() -> None:
    sched, conn, _ = make()
    bm = sched.block_manager
    local = Sequence("warm", list(range(8)) + [99, 98], SamplingParams(max_tokens=1))
    sched.add(local)
    run_step(sched, sched.schedule())
    sched.finish(local, SequenceStatus.FINISHED_LENGTH)  # its 2 full blocks stay cached
    seq = remote_seq(list(range(8)) + [50, 51, 52], [4, 5, 6])
    sched.add(seq)
    sched.schedule()
    (load,) = conn.build_connector_meta().loads
    table = bm.get_block_table(seq)
    assert load.remote_block_ids == (6,) and load.local_block_ids == (table[2],)  # blocks 0-1 hit locally
    assert conn.stats.external_prefix_cache_queries == 3
    run_step(sched, SchedulerOutput(), finished_recving=frozenset({"d1"}))
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    bm.check_integrity()
    assert bm.num_free_blocks == 16


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_read_recomputes_or_fails(policy: str) -> None:
    sched, conn, _ = make(policy)
    seq = remote_seq(list(range(10)), [0, 1, 2])
    sched.add(seq)
    sched.schedule()
    conn.build_connector_meta()
    run_step(sched, SchedulerOutput(), kv_connector_output=TransferReport(failed_recving={"d1": "NIXL read: boom"}))
    assert conn.stats.num_failed_transfers == 1
    assert sched.block_manager.num_free_blocks == 16  # the blocks it held for the read are back
    if policy == "recompute":
        assert conn.take_failed() == {}
        plan = sched.schedule()
        (s,) = plan.scheduled
        assert s.start_pos == 0 and s.num_tokens == 10  # its whole prompt, here
        assert conn.build_connector_meta() is None  # never asks the remote engine again
    else:
        failed = conn.take_failed()
        assert "boom" in failed["d1"] and "kv_load_failure_policy is 'fail'" in failed["d1"]
        assert sched.schedule().is_empty
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert not conn.has_pending()


def test_an_abort_while_the_read_runs_keeps_the_blocks_until_it_ends() -> None:
    sched, conn, _ = make()
    seq = remote_seq(list(range(10)), [0, 1, 2])
    sched.add(seq)
    sched.schedule()
    conn.build_connector_meta()
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert sched.block_manager.num_free_blocks == 13  # the read still writes into them
    assert conn.has_pending()
    run_step(sched, SchedulerOutput(), finished_recving=frozenset({"d1"}))
    assert sched.block_manager.num_free_blocks == 16 and not conn.has_pending()
    assert not sched.running


def test_a_prefill_for_remote_decode_leases_its_blocks_until_notified() -> None:
    sched, conn, _ = make()
    seq = Sequence("p1", list(range(10)), SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    sched.add(seq)
    run_step(sched, sched.schedule())
    table = list(sched.block_manager.get_block_table(seq))
    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    out = conn.take_kv_transfer_params("p1")
    assert out == {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": table,
                   "remote_engine_id": "decode", "remote_host": "localhost", "remote_port": 5999, "tp_size": 1,
                   "remote_request_id": "p1"}
    assert sched.block_manager.num_free_blocks == 13 and conn.stats.num_leased_blocks == 3
    run_step(sched, SchedulerOutput(), finished_sending=frozenset({"p1"}))
    assert sched.block_manager.num_free_blocks == 16 and conn.stats.num_leased_blocks == 0
    assert conn.stats.num_kv_expired_reqs == 0
    sched.block_manager.check_integrity()


def test_a_lease_nobody_reads_expires_and_is_counted() -> None:
    sched, conn, clock = make(lease=5.0)
    seq = Sequence("p1", list(range(6)), SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    sched.add(seq)
    run_step(sched, sched.schedule())
    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    clock.now += 4.9
    conn.expire_leases()
    assert sched.block_manager.num_free_blocks == 14
    clock.now += 0.2
    run_step(sched, SchedulerOutput())
    assert sched.block_manager.num_free_blocks == 16 and conn.stats.num_kv_expired_reqs == 1
    run_step(sched, SchedulerOutput(), finished_sending=frozenset({"p1"}))  # a late notification: nothing left
    assert conn.stats.num_kv_expired_reqs == 1 and not conn.has_pending()


def test_an_aborted_prefill_is_not_leased() -> None:
    sched, conn, _ = make()
    seq = Sequence("p1", list(range(6)), SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    sched.add(seq)
    sched.schedule()
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert conn.take_kv_transfer_params("p1") is None and sched.block_manager.num_free_blocks == 16


def test_remote_blocks_for_another_prompt_length_compute_locally() -> None:
    sched, conn, _ = make()
    seq = remote_seq(list(range(10)), [0, 1])  # 10 tokens need 3 blocks
    sched.add(seq)
    (s,) = sched.schedule().scheduled
    assert s.num_tokens == 10 and conn.build_connector_meta() is None
    assert conn.stats.num_failed_transfers == 1


def test_no_room_for_the_read_keeps_it_first_in_line() -> None:
    sched, conn, _ = make(num_blocks=4)
    big = Sequence("big", list(range(12)), SamplingParams(max_tokens=4))
    sched.add(big)
    sched.schedule()  # holds 3 of 4 blocks
    seq = remote_seq(list(range(10)), [0, 1, 2])
    sched.add(seq)
    sched.schedule()
    assert sched.waiting[0] is seq and seq.status is SequenceStatus.WAITING
    sched.finish(big, SequenceStatus.FINISHED_ABORTED)
    sched.schedule()
    assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV


def test_config_and_params_refuse_by_name() -> None:
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_load_failure_policy": "retry"})
    with pytest.raises(ValueError, match="kv_connector 'LMCacheConnectorV1'"):
        KVTransferConfig.from_dict({"kv_connector": "LMCacheConnectorV1"})
    with pytest.raises(ValueError, match="keys kv_ip"):
        KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_ip": "1.2.3.4"})
    with pytest.raises(ValueError, match="remote_block_ids, remote_engine_id"):
        kv_params.check({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1})
    with pytest.raises(ValueError, match="keys do_remote"):
        kv_params.check({"do_remote": True})


def test_side_channel_port_comes_from_either_environment_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOKER_NIXL_SIDE_CHANNEL_PORT", raising=False)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "6100")
    assert KVTransferConfig().side_channel_port == 6100
    monkeypatch.setenv("STOKER_NIXL_SIDE_CHANNEL_PORT", "6200")
    assert KVTransferConfig().side_channel_port == 6200


def test_compat_names_the_first_field_that_differs() -> None:
    mine = {f: 1 for f in compat.FIELDS}
    assert compat.first_difference(mine, dict(mine)) is None
    msg = compat.first_difference(mine, {**mine, "block_size": 32, "tp_size": 2})
    assert msg is not None and "block_size differs" in msg and "32" in msg
    assert compat.compat_hash(mine) != compat.compat_hash({**mine, "kv_dtype": "fp8_e4m3"})


def test_the_scheduler_side_is_torch_free() -> None:
    from tests.unit.test_pure_python import assert_torch_free

    assert_torch_free(["stoker.kv_transfer.config", "stoker.kv_transfer.params", "stoker.kv_transfer.metadata",
                       "stoker.kv_transfer.base", "stoker.kv_transfer.compat", "stoker.kv_transfer.stats",
                       "stoker.kv_transfer.scheduler_side", "stoker.kv_transfer.side_channel",
                       "stoker.kv_transfer.multi"])


def test_tensor_parallel_ranks_end_a_read_or_a_lease_together() -> None:
    """TP=2: each rank reads its own heads and is notified for its own; the scheduler hears of a
    read once both parts arrived (failed if either failed, but only once both ended: a rank
    still reading writes into the blocks) and of a lease's end once both readers notified."""
    from stoker.kv_transfer.aggregate import FinishedAggregator
    from stoker.kv_transfer.metadata import RankFinished

    agg = FinishedAggregator(world_size=2)
    out = agg.merge([RankFinished(recving=frozenset({"a"}), sending=frozenset({"p"}),
                                  report=TransferReport(transfers={"a": (0.02, 100)})),
                     RankFinished(report=TransferReport(failed_recving={"b": "NIXL read: boom"}))])
    assert not out.recving and not out.sending and not out.report and agg.pending() == 3
    out = agg.merge([RankFinished(), RankFinished(recving=frozenset({"a"}), sending=frozenset({"p"}),
                                                  report=TransferReport(transfers={"a": (0.05, 100)}))])
    assert out.recving == {"a"} and out.sending == {"p"} and out.report.transfers == {"a": (0.05, 200)}
    out = agg.merge([RankFinished(recving=frozenset({"b"}), report=TransferReport(transfers={"b": (0.01, 100)})),
                     RankFinished()])
    assert not out.recving and out.report.failed_recving == {"b": "rank 1: NIXL read: boom"} and agg.pending() == 0


@pytest.mark.parametrize("read", ["arrives", "fails"])
def test_a_host_tier_hit_loads_first_blocks_and_the_read_covers_only_the_rest(read: str) -> None:
    """Claims at admission, each block once: device prefix hit, then the host tier, then the
    remote engine. A failed read (policy recompute) keeps the host-loaded blocks as a device hit."""
    from stoker.core.host_kv_pool import HostKVPool

    sched, conn, _ = make()
    bm = sched.block_manager
    pool = HostKVPool(8, BS, bytes_per_block=64)
    sched.host_kv, bm.on_evict = pool, pool.offer
    warm = Sequence("warm", list(range(8)) + [99, 98], SamplingParams(max_tokens=1))
    sched.add(warm)
    run_step(sched, sched.schedule())
    sched.finish(warm, SequenceStatus.FINISHED_LENGTH)  # its 2 full blocks cached on the device
    filler = Sequence("fill", [200 + i for i in range(63)], SamplingParams(max_tokens=1))
    sched.add(filler)
    plan = sched.schedule()  # takes all 16 blocks: the 2 cached ones are evicted, saved to host
    assert len(plan.kv_host_saves) == 2
    run_step(sched, plan)
    sched.finish(filler, SequenceStatus.FINISHED_LENGTH)
    seq = remote_seq(list(range(8)) + [50, 51, 52], [4, 5, 6])
    sched.add(seq)
    plan = sched.schedule()
    table = bm.get_block_table(seq)
    assert plan.is_empty and seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV
    assert [dst for _, dst in plan.kv_host_loads] == table[:2] and seq.num_computed_tokens == 8
    (load,) = conn.build_connector_meta().loads
    assert load.remote_block_ids == (6,) and load.local_block_ids == (table[2],)  # blocks 0-1 came from host
    assert conn.stats.external_prefix_cache_queries == 3 and pool.stats().hit_blocks == 2
    run_step(sched, plan)  # the admission step (its host loads) came back
    if read == "arrives":
        run_step(sched, SchedulerOutput(), finished_recving=frozenset({"d1"}))
        plan = sched.schedule()
        (s,) = plan.scheduled
        assert s.start_pos == 10 and s.num_tokens == 1
    else:
        run_step(sched, SchedulerOutput(), kv_connector_output=TransferReport(failed_recving={"d1": "boom"}))
        plan = sched.schedule()
        (s,) = plan.scheduled
        assert s.start_pos == 8 and s.num_tokens == 3 and seq.num_cached_tokens == 8  # host hit kept
        assert not plan.kv_host_loads and conn.build_connector_meta() is None
    run_step(sched, plan)
    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    bm.check_integrity()
    pool.check_integrity()
    assert bm.num_free_blocks == 16 and pool.is_idle and not conn.has_pending()


def test_vllm_spellings_of_nixl_beside_the_host_tier() -> None:
    from stoker.kv_transfer.multi import merge_offloading_size, resolve

    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30}}
    for order in ([nixl, offload], [offload, nixl]):  # the claims do not depend on the order
        cfg, gib = resolve({"kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": "e1",
                            "kv_connector_extra_config": {"connectors": order}})
        assert cfg is not None and cfg.kv_role == "kv_consumer" and cfg.engine_id == "e1" and gib == 8.0
    assert resolve(offload) == (None, 8.0)
    cfg, gib = resolve('{"kv_connector": "NixlConnector"}')
    assert cfg is not None and gib is None
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [nixl, nixl]}}
    with pytest.raises(ValueError, match="lists a connector twice"):
        resolve(multi)
    with pytest.raises(ValueError, match="connector 'LMCacheConnectorV1' is not supported"):
        resolve({**multi, "kv_connector_extra_config": {"connectors": [{"kv_connector": "LMCacheConnectorV1"}]}})
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        resolve({"kv_connector": "OffloadingConnector"})
    with pytest.raises(ValueError, match="keys num_cpu_blocks"):
        resolve({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 8}})
    with pytest.raises(ValueError, match="kv_role must be kv_both"):
        resolve({**multi, "kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="given twice"):
        merge_offloading_size(4.0, 8.0)
    assert merge_offloading_size(8.0, 8.0) == merge_offloading_size(None, 8.0) == merge_offloading_size(8.0, None) == 8.0


def test_the_external_prefix_cache_is_exported_once_beside_the_host_tier() -> None:
    from stoker.core.host_kv_pool import HostKVStats
    from stoker.kv_transfer.metrics import kv_transfer_metrics
    from stoker.kv_transfer.stats import KVTransferStats
    from stoker.server.observe.host_kv_metrics import host_kv_metrics

    host = HostKVStats(8, 2, query_tokens=40, hit_tokens=32, lookup_blocks=2, hit_blocks=2, saved_blocks=2,
                       loaded_blocks=2, saved_bytes=128, loaded_bytes=128, evicted_blocks=0, skipped_saves=0)
    remote = KVTransferStats(external_prefix_cache_queries=8, external_prefix_cache_hits=8)
    families = [*host_kv_metrics(host, [], [], remote_hit_tokens=remote.external_prefix_cache_hits),
                *kv_transfer_metrics(remote, [], [], external_prefix_cache=False)]
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    by_name = {f.name: f.samples[0].value for f in families}
    assert by_name["vllm:external_prefix_cache_queries"] == 40 and by_name["vllm:external_prefix_cache_hits"] == 40
    alone = {f.name: f.samples[0].value for f in kv_transfer_metrics(remote, [], [])}
    assert alone["vllm:external_prefix_cache_hits"] == 8
