"""The environment contract: :class:`Environment`, :class:`StepResult`, :class:`State`.

An environment is a class generic over its action, observation and state types.
``reset`` and ``step`` may each be ``async def`` or plain ``def``::

    class Guess(msgspec.Struct):
        word: str

    class Feedback(msgspec.Struct):
        hint: str

    class Game(stadium.Environment[Guess, Feedback, stadium.State]):
        async def reset(self, *, seed=None, options=None) -> Feedback:
            return Feedback(hint="guess a word")

        async def step(self, action: Guess) -> stadium.StepResult[Feedback]:
            return stadium.StepResult(Feedback(hint="warmer"), reward=0.5, done=False)

The server creates one instance per session (per WebSocket connection) and
calls it from one task at a time; an instance never sees two calls at once.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Awaitable
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from stadium._env.cost import EpisodeCost
from stadium._env.snapshot import pickle_state, restore_state

ActT = TypeVar("ActT")
ObsT = TypeVar("ObsT")
StateT = TypeVar("StateT")

MaybeAwaitable = typing.Union[ObsT, Awaitable[ObsT]]  # noqa: UP007 - a generic alias


class State(msgspec.Struct, kw_only=True):
    """Base state: the episode id and the steps taken in it.

    Subclass it to add fields. The server fills ``episode_id`` and ``step_count``
    in the ``state`` reply when the environment leaves them unset.
    """

    episode_id: str | None = None
    step_count: int = 0


@dataclasses.dataclass(slots=True)
class StepResult(Generic[ObsT]):
    """What ``step`` (and optionally ``reset``) returns.

    Args:
        observation: the observation, of the environment's observation type.
        reward: the reward of the transition (``None`` at reset).
        done: the episode is over, for whatever reason.
        truncated: the episode was cut short (time limit) rather than ended by
            the environment's own dynamics. Implies ``done``.
        info: extra diagnostics, carried to the client as ``info``.
        cost: what the episode cost (:class:`~stadium._env.cost.EpisodeCost`), on the
            result of the step that ended it, as a Stadium client receives it; the
            server measures it (an env never sets it).

    ``StepResult.gym(obs, reward, terminated, truncated, info)`` builds one from
    Gymnasium's five-tuple.
    """

    observation: ObsT
    reward: float | None = None
    done: bool = False
    _: dataclasses.KW_ONLY
    truncated: bool = False
    info: dict[str, Any] | None = None
    cost: EpisodeCost | None = None

    def __post_init__(self) -> None:
        if self.truncated:
            self.done = True

    @property
    def terminated(self) -> bool:
        """Gymnasium's ``terminated``: done and not truncated."""
        return self.done and not self.truncated

    @classmethod
    def gym(
        cls,
        observation: ObsT,
        reward: float,
        terminated: bool,
        truncated: bool,
        info: dict[str, Any] | None = None,
    ) -> StepResult[ObsT]:
        """Build a result from Gymnasium's ``(obs, reward, terminated, truncated, info)``."""
        return cls(
            observation, reward, terminated or truncated, truncated=truncated, info=info or None
        )


class Environment(Generic[ActT, ObsT, StateT]):
    """Base class of every Stadium environment.

    Class attributes a subclass may set:

    * ``name``, ``version``, ``description``: shown by ``GET /metadata``.
    * ``blocking`` (default ``True``): whether a *sync* ``reset``/``step`` may block
      (I/O, heavy CPU). Blocking calls run on a bounded shared thread pool, so they
      never hold up other sessions; set ``blocking = False`` for cheap pure-Python
      environments to run them inline on the event loop (faster). Async methods
      always run on the loop.
    * ``action_type``, ``observation_type``, ``state_type``: normally taken from
      the generic parameters ``Environment[Act, Obs, State]``; set them when the
      class is not parametrised that way.
    * ``allow_extra_fields`` (default ``False``): a ``msgspec.Struct`` action with a
      field the type does not declare is a ``VALIDATION_ERROR`` naming it; set
      ``True`` to accept (and drop) unknown fields.
    * ``step_before_reset`` (default ``False``): a ``step`` sent before any ``reset``
      is a ``SESSION_ERROR``; set ``True`` to step the instance as ``__init__`` left it
      (what OpenEnv's server does; OpenEnv envs served by Stadium have it on).

    An environment may also define ``sample_action(self, rng: random.Random) -> Act``,
    which :func:`stadium.check_env` uses to try actions.

    :meth:`snapshot` / :meth:`restore` turn an instance's episode into bytes and back
    (``stadium serve --durable``, fork); the default pickles the instance state.

    Types may be ``msgspec.Struct`` (recommended), dataclasses, ``TypedDict`` or
    plain ``dict``: anything msgspec can validate and describe as JSON Schema.
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0.0.0"
    description: ClassVar[str] = ""
    blocking: ClassVar[bool] = True
    allow_extra_fields: ClassVar[bool] = False
    step_before_reset: ClassVar[bool] = False
    action_type: ClassVar[Any]
    observation_type: ClassVar[Any]
    state_type: ClassVar[Any] = State

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Environment):
                args = typing.get_args(base)
                if len(args) == 3:
                    for attr, arg in zip(
                        ("action_type", "observation_type", "state_type"), args, strict=True
                    ):
                        if attr not in cls.__dict__ and not isinstance(arg, TypeVar):
                            setattr(cls, attr, arg)
        if not cls.__dict__.get("name"):
            cls.name = cls.__name__

    @classmethod
    def prepare_kwargs(cls, env_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments sessions' envs are made with, from ``--env-kwargs``.

        Called by the server (on its own filesystem, as its user) before sessions' envs
        are made in processes of their own (``--isolation process|sandbox``), whose
        filesystem may be a task image where the server's files are not: read the files
        ``env_kwargs`` names here and return what they hold instead (it goes to each
        session's process, so keep it JSON-like). Not called with ``--untrusted-env-code``
        (the env's code never runs on the server). Default: ``env_kwargs`` as given.
        """
        return env_kwargs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> MaybeAwaitable[ObsT | StepResult[ObsT]]:
        """Start a new episode and return its first observation.

        Args:
            seed: seeds the episode's randomness; the same seed and actions must
                give the same observations.
            options: environment-specific reset options.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement reset()")

    def step(self, action: ActT) -> MaybeAwaitable[StepResult[ObsT] | ObsT]:
        """Apply ``action`` and return the next observation with reward and done."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    @property
    def state(self) -> StateT:
        """The environment's state (episode id, step count and anything else)."""
        return typing.cast(StateT, State())

    def close(self) -> MaybeAwaitable[None]:
        """Release resources; called once when the session ends."""
        return None

    def snapshot(self) -> bytes:
        """The instance's episode as bytes, for :meth:`restore` on a fresh instance.

        The default pickles (protocol 5) the instance state as ``__getstate__``
        gives it: ``__dict__`` and slots, so the step counter and any per-instance
        RNG (``random.Random``, ``numpy.random.Generator``) come along and a
        restored episode continues exactly. Define ``__getstate__`` to leave out
        what belongs to the process (a pid, a cache; :meth:`restore` keeps the
        fresh instance's values for those), or override both methods for state
        that does not pickle (connections, threads, native handles) — e.g. a
        seed and the actions so far, replayed by :meth:`restore`.

        The server calls it synchronously on the event loop, right after a call
        that changed the env and before that call's reply is sent; never while
        another call runs on the instance. So it must be cheap: the default costs
        3-10 µs for the built-in envs, ~60 µs for CartPole and ~30 µs for 1 MB of
        bytes (``scripts/bench-snapshot.py``). An env whose state is large or
        slow to pickle should snapshot something smaller instead.

        Raises:
            stadium.SnapshotError: the state does not pickle; the message names
                the attribute.
        """
        return pickle_state(self)

    def restore(self, data: bytes) -> None:
        """Take the episode of ``data`` (from :meth:`snapshot`) into this instance, in place.

        The server builds a fresh instance with the env's factory (``__init__``
        has run) and calls this once, before any other call. The default sets the
        snapshot's attributes on ``self``.

        Security: snapshots are pickles; restore only snapshots from a trusted
        store (one only the server writes), never bytes from a client.

        Raises:
            stadium.SnapshotError: ``data`` is a snapshot of another class, or
                cannot be read.
        """
        restore_state(self, data)


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine (an ``async def``)."""
    return inspect.iscoroutinefunction(fn)
