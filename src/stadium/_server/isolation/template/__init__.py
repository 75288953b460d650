"""The env's side of isolated sessions: the template process and what it forks (in a sandbox
or not). :mod:`.boot` is the template's first code, :mod:`.child` the template,
:mod:`.env_process` each session's process, :mod:`.rootfs` a task image's root (the family
init's side), :mod:`.seccomp` the sandboxed sessions' filter."""
