"""The batch rules as strategies (``streamrl.algorithms.batching``): what each rule trains, drains and waits for,
on hand-made episodes (the trainer's end-to-end tests run them on real rollouts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms.base import Episode, make_algorithm
from streamrl.algorithms.batching import AnyVersion, CurrentVersion, EpisodeBuffer, Groups, batch_rule
from streamrl.algorithms.tracker import Ticket


def episode(index: int, version: int, reward: float = 1.0, group: int | None = None) -> Episode:
    ticket = Ticket(f"task-{index}", version, None, index, 0.0)
    trajectory = Trajectory(task_id=ticket.task_id, ticket=ticket).set_outcome(
        reward, bool(reward), True, False
    )
    return Episode(trajectory, ticket, group)


def job(version: int) -> SimpleNamespace:
    return SimpleNamespace(ticket=Ticket("t", version, None, 99, 0.0))


def test_each_algorithm_owns_the_strategy_its_config_names() -> None:
    assert type(make_algorithm("spo++").batch_rule) is CurrentVersion
    assert type(make_algorithm("spo").batch_rule) is AnyVersion
    grpo = make_algorithm("grpo", group_size=4).batch_rule
    assert type(grpo) is Groups and grpo.group_size == 4 and not grpo.one_per_task
    with pytest.raises(ValueError, match=r"batch_rule must be one of \('current-version', 'any', 'groups'\)"):
        batch_rule("newest")
    with pytest.raises(ValueError, match="group_size=2 needs batch_rule='groups'"):
        batch_rule("any", 2).check(batch=4, num_envs=4, algorithm="spo")
    with pytest.raises(ValueError, match="batch=6 must be a multiple of grpo's group_size=4"):
        grpo.check(batch=6, num_envs=8, algorithm="grpo")


def test_current_version_drains_superseded_work_and_never_waits() -> None:
    buffer = EpisodeBuffer(CurrentVersion(), keep_group=lambda rewards: True)
    old, new = episode(0, version=0), episode(1, version=1)
    assert not buffer.rule.admits(old, 1) and buffer.rule.admits(new, 1)
    for e in (old, new):
        assert buffer.add(e) == []
    assert buffer.drain(1) == [old] and buffer.episodes == [new]
    assert not buffer.rule.must_wait(True, [job(0)], limit=0)  # old in-flight work is dropped on return
    assert buffer.take(1, publishing=True, limit=5) == [
        new
    ]  # nothing is "due": it trains the current version


def test_trainable_room_counts_only_current_version_work_against_what_the_version_still_trains() -> None:
    rule = CurrentVersion()
    buffer = [episode(0, version=2), episode(1, version=1)]  # the old one is drained at the publication
    in_flight = [job(2), job(2), job(1)]  # the old one is dropped when it returns
    assert rule.trainable_room(8, buffer, in_flight, version=2) == 8 - 3
    assert rule.trainable_room(2, buffer, in_flight, version=2) == 0  # never negative
    for other in (AnyVersion(), Groups(2)):  # they train old work within the bound: no cap but admission
        assert other.trainable_room(8, buffer, in_flight, version=2) is None


def test_any_rule_trains_the_due_episodes_first_and_waits_for_old_work_before_a_publication() -> None:
    buffer = EpisodeBuffer(AnyVersion(), keep_group=lambda rewards: True)
    recent, old_late, old_early = episode(5, 1), episode(3, 0), episode(2, 0)
    for e in (recent, old_late, old_early):
        buffer.add(e)
    assert buffer.drain(2) == []  # 'any' keeps old work within the staleness bound
    assert buffer.rule.must_wait(True, [job(1), job(0)], limit=0)
    assert not buffer.rule.must_wait(False, [job(0)], limit=0)  # no publication: nothing gets too old
    # both version-0 episodes are due (oldest dispatch first), one more than the batch size asked for
    assert buffer.take(1, publishing=True, limit=0) == [old_early, old_late]
    assert buffer.take(2, publishing=False, limit=0) is None  # one left: no batch of two
    assert buffer.take(1, publishing=False, limit=0) == [recent] and buffer.episodes == []


def test_groups_enter_whole_a_due_member_takes_its_group_and_a_failure_closes_it_smaller() -> None:
    dapo = make_algorithm("grpo", group_size=2, variant="dapo")
    buffer = EpisodeBuffer(dapo.batch_rule, keep_group=dapo.keep_group)
    g0, g1, g2 = buffer.new_group(), buffer.new_group(), buffer.new_group()
    a, b = episode(0, 0, 1.0, g0), episode(1, 1, 0.0, g0)
    assert buffer.add(a) == [] and buffer.episodes == []  # the group waits for its second member
    assert buffer.add(b) == [] and buffer.episodes == [a, b]
    same = [episode(2, 1, 1.0, g1), episode(3, 1, 1.0, g1)]
    assert buffer.add(same[0]) == [] and buffer.add(same[1]) == same  # DAPO: no reward variance, dropped
    lone = episode(4, 1, 1.0, g2)
    assert buffer.add(lone) == [] and buffer.fail(episode(5, 1, 0.0, g2)) == [lone]  # one member is no group
    # a's version is due before publishing: it takes b (a newer version) along
    assert buffer.take(1, publishing=True, limit=0) == [a, b]
    assert buffer.waiting() == [] and buffer.groups == {}


def test_the_buffer_state_survives_a_checkpoint() -> None:
    buffer = EpisodeBuffer(Groups(2), keep_group=lambda rewards: True)
    g = buffer.new_group()
    buffer.add(episode(0, 0, 1.0, g))
    buffer.new_group()
    again = EpisodeBuffer(Groups(2), keep_group=lambda rewards: True)
    again.load_state_dict(buffer.state_dict())
    assert again.state_dict() == buffer.state_dict() and again.next_group == 2
    assert [e.ticket for e in again.waiting()] == [e.ticket for e in buffer.waiting()]
