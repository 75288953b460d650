"""The worker's side of isolated sessions: :mod:`.isolation` (the :class:`Isolation`: the
template, the warm pool, the env processes' lifecycle), :mod:`.proc` (one env process as the
worker holds it), :mod:`.proxy` (the env a session drives), :mod:`.imaging` (task images),
:mod:`.output` (the processes' output), :mod:`.reaper` (teardown off the loop), :mod:`.netns`
(the sessions' networks), :mod:`.manifest` (an ``openenv.yaml``'s limits)."""
