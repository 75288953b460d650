"""The seccomp filter of sandboxed sessions: Docker's default profile for an unprivileged
container (no capabilities), made stricter where Stadium's sessions need less, built with
libseccomp (called through :mod:`ctypes`).

Why ctypes on ``libseccomp.so.2`` rather than the ``seccomp`` Python bindings: the bindings
(Debian ``python3-seccomp``) are built for the system's Python only, not for the venv's
interpreter the server runs on; the C library is one file with a stable ABI (its calls
here are in libseccomp since 2.0, and ``seccomp_rule_add_array`` is the non-variadic
form, safe to call through ctypes), and the filter it compiles is the same.

The filter is built and compiled to BPF once per template process (:func:`build_filter`,
a few ms) and installed in each session's family (:meth:`Filter.load`: one ``prctl``, a
few microseconds) after :func:`~stadium._server.isolation.template.confine.enter_sandbox`: after the
session's mounts and namespaces are made and its uid dropped, before the env is built.
Every process the env forks inherits it; it can never be removed.

It is an allow-list, as Docker's is (moby ``profiles/seccomp/default.json``): a call not
allowed gets ``EPERM`` (Docker's default action), ``clone3`` ``ENOSYS`` (its flags sit in
memory the filter cannot read; the C library falls back to ``clone``), and a call newer
than the libseccomp the server runs on knows by name (numbers it cannot name) ``ENOSYS``,
so the C library's fallbacks work. Denied calls return an error rather than killing the
process: code that probes goes on with the refusal, and a hostile env sees an ``OSError``
in its own step. Calls made for another architecture (the i386 ABI through ``int 0x80``,
the x32 ABI) kill the process: the filter knows the native architecture only (Docker
allows i386 and x32 calls too).

:data:`DOCKER_ALLOWED` is Docker's list for an amd64 container with no capability (its
unconditional rules, the amd64 ones, and those for kernels >= 4.8); :data:`ALLOWED` is it
less :data:`STRICTER`. Argument rules, as Docker's unless said: ``clone`` only without a
``CLONE_NEW*`` flag (mask ``0x7E020000``), ``personality`` only with Docker's five values
(:data:`PERSONALITIES`), ``socket`` only for ``AF_UNIX``, ``AF_INET``, ``AF_INET6``.

Every call that differs from Docker's profile for an unprivileged container, and why:

========================================  ======================================================
calls                                     Stadium refuses; Docker allows them because...
========================================  ======================================================
ptrace, process_vm_readv,                 Docker allows them on kernels >= 4.8 (the kernel's
process_vm_writev                         ptrace checks suffice there); a session never needs
                                          to trace or read another process, and they are the
                                          first tool of an escape (a process that changed uid
                                          is not dumpable anyway)
modify_ldt                                16-bit segments (Docker allows it on x86): old,
                                          leak-prone, used by nothing a session runs
adjtimex, clock_adjtime, clock_adjtime64  Docker allows the read-only form (setting needs a
                                          capability); a session has no use for the clock's
                                          discipline
socket with a family other than AF_UNIX,  Docker refuses only AF_ALG (38) and AF_VSOCK (40);
AF_INET, AF_INET6                         Stadium refuses netlink (the kernel's routing and
                                          firewall interfaces), AF_PACKET (raw frames) and
                                          the rarer families behind many kernel bugs
calls newer than libseccomp's table       ``ENOSYS``: the filter cannot name them, the C
(numbers below 600 it cannot name; with   library falls back. Docker allows some of them:
libseccomp 2.5.4: 335, 457 and on)        ``uretprobe``, ``statmount``, ``listmount``,
                                          ``mseal``, ``setxattrat`` and the other ``*xattrat``
i386 and x32 calls                        killed (Docker allows both ABIs on amd64)
========================================  ======================================================

What both refuse (not in Docker's list for an unprivileged container): mounts and the new
mount API, ``unshare``/``setns``/``clone`` with namespace flags, ``bpf``, ``perf_event_open``,
``userfaultfd``, the keyring (``keyctl``, ``add_key``, ``request_key``), ``io_uring_*``
(Docker removed them in 2023: a second system-call interface a filter cannot see into),
kernel modules, ``kexec_*``, ``reboot``, ``swapon``/``swapoff``, ``syslog``, ``acct``,
``sethostname``/``setdomainname``, ``vhangup``, setting the clock, ``iopl``/``ioperm``,
``quotactl``, ``open_by_handle_at``, ``fanotify_init``, ``kcmp``, ``pidfd_getfd``,
``process_madvise``, ``mbind``/``set_mempolicy``/``get_mempolicy``/``migrate_pages``/
``move_pages``, ``lookup_dcookie``, ``nfsservctl``, ``uselib``, ``ustat``, ``sysfs``,
``_sysctl``, ``personality`` with any other value, and every other call Docker does not list.

Not a sandbox by itself: the session is also an unprivileged uid with ``no_new_privs`` in
its own namespaces (see :mod:`.sandbox`); the filter narrows what kernel code that uid can
reach. Kernel bugs in the calls still allowed remain reachable (docs/ISOLATION.md, "What each
level protects against").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import os
import socket
from typing import Any

from stadium._errors import ConfigError
from stadium._util.libc import PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, libc

#: The name the startup log and the template's ``ready`` report give the filter.
NAME = "stadium-docker-strict-v2"
LIBRARY = "libseccomp.so.2"

_SECCOMP_MODE_FILTER = 2
_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_CMP_EQ = 4
_CMP_MASKED_EQ = 7
_FLTATR_CTL_OPTIMIZE = 8
"""libseccomp's attribute choosing the program's shape (2: a binary tree of call numbers,
so a call costs ~log2 of the rules, not their number)."""

#: ``clone`` is allowed only when none of these flags is set (Docker's mask: every
#: ``CLONE_NEW*`` flag, ``CLONE_NEWTIME`` aside, which ``unshare``/``clone3`` alone take).
CLONE_NAMESPACE_MASK = 0x7E020000
#: The ``personality`` values allowed (Docker's): the default, ``UNAME26``, ``ADDR_NO_RANDOMIZE``
#: (with and without ``UNAME26``), and the query (``0xffffffff``).
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
#: Socket families a session may open (every other one is refused).
ALLOWED_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
#: Call numbers past the libseccomp table's end that get ``ENOSYS`` (see the docstring).
NEW_CALLS_END = 600

#: Docker's default profile (moby ``profiles/seccomp/default.json``, June 2026) for an amd64
#: container with no capability: its unconditional allow rule, its amd64 rules
#: (``arch_prctl``, ``modify_ldt``) and its rule for kernels >= 4.8 (``ptrace``,
#: ``process_vm_readv``, ``process_vm_writev``). Its argument rules (``clone``,
#: ``personality``, ``socket``) are applied apart; names of other architectures are
#: skipped when the filter is built.
_DOCKER_NAMES = """
    accept accept4 access adjtimex alarm bind brk cachestat capget capset chdir chmod
    chown chown32 clock_adjtime clock_adjtime64 clock_getres clock_getres_time64
    clock_gettime clock_gettime64 clock_nanosleep clock_nanosleep_time64 close
    close_range connect copy_file_range creat dup dup2 dup3 epoll_create epoll_create1
    epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2 epoll_wait epoll_wait_old eventfd
    eventfd2 execve execveat exit exit_group faccessat faccessat2 fadvise64 fadvise64_64
    fallocate fanotify_mark fchdir fchmod fchmodat fchmodat2 fchown fchown32 fchownat
    fcntl fcntl64 fdatasync fgetxattr flistxattr flock fork fremovexattr fsetxattr fstat
    fstat64 fstatat64 fstatfs fstatfs64 fsync ftruncate ftruncate64 futex futex_requeue
    futex_time64 futex_wait futex_waitv futex_wake futimesat getcpu getcwd getdents
    getdents64 getegid getegid32 geteuid geteuid32 getgid getgid32 getgroups getgroups32
    getitimer getpeername getpgid getpgrp getpid getppid getpriority getrandom getresgid
    getresgid32 getresuid getresuid32 getrlimit get_robust_list getrusage getsid
    getsockname getsockopt get_thread_area gettid gettimeofday getuid getuid32 getxattr
    getxattrat inotify_add_watch inotify_init inotify_init1 inotify_rm_watch io_cancel
    ioctl io_destroy io_getevents io_pgetevents io_pgetevents_time64 ioprio_get
    ioprio_set io_setup io_submit ipc kill landlock_add_rule landlock_create_ruleset
    landlock_restrict_self lchown lchown32 lgetxattr link linkat listen listmount
    listxattr listxattrat llistxattr _llseek lremovexattr lseek lsetxattr lstat lstat64
    madvise map_shadow_stack membarrier memfd_create memfd_secret mincore mkdir mkdirat
    mknod mknodat mlock mlock2 mlockall mmap mmap2 mprotect mq_getsetattr mq_notify
    mq_open mq_timedreceive mq_timedreceive_time64 mq_timedsend mq_timedsend_time64
    mq_unlink mremap mseal msgctl msgget msgrcv msgsnd msync munlock munlockall munmap
    name_to_handle_at nanosleep newfstatat _newselect open openat openat2 pause
    pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll
    ppoll ppoll_time64 prctl pread64 preadv preadv2 prlimit64 process_mrelease pselect6
    pselect6_time64 pwrite64 pwritev pwritev2 read readahead readlink readlinkat readv
    recv recvfrom recvmmsg recvmmsg_time64 recvmsg remap_file_pages removexattr
    removexattrat rename renameat renameat2 restart_syscall riscv_hwprobe rmdir rseq
    rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend
    rt_sigtimedwait rt_sigtimedwait_time64 rt_tgsigqueueinfo sched_getaffinity
    sched_getattr sched_getparam sched_get_priority_max sched_get_priority_min
    sched_getscheduler sched_rr_get_interval sched_rr_get_interval_time64
    sched_setaffinity sched_setattr sched_setparam sched_setscheduler sched_yield
    seccomp select semctl semget semop semtimedop semtimedop_time64 send sendfile
    sendfile64 sendmmsg sendmsg sendto setfsgid setfsgid32 setfsuid setfsuid32 setgid
    setgid32 setgroups setgroups32 setitimer setpgid setpriority setregid setregid32
    setresgid setresgid32 setresuid setresuid32 setreuid setreuid32 setrlimit
    set_robust_list setsid setsockopt set_thread_area set_tid_address setuid setuid32
    setxattr setxattrat shmat shmctl shmdt shmget shutdown sigaltstack signalfd
    signalfd4 sigprocmask sigreturn socketcall socketpair splice stat stat64 statfs
    statfs64 statmount statx symlink symlinkat sync sync_file_range syncfs sysinfo tee
    tgkill time timer_create timer_delete timer_getoverrun timer_gettime timer_gettime64
    timer_settime timer_settime64 timerfd_create timerfd_gettime timerfd_gettime64
    timerfd_settime timerfd_settime64 times tkill truncate truncate64 ugetrlimit umask
    uname unlink unlinkat uretprobe utime utimensat utimensat_time64 utimes vfork
    vmsplice wait4 waitid waitpid write writev
    arch_prctl modify_ldt ptrace process_vm_readv process_vm_writev
"""
DOCKER_ALLOWED = frozenset(_DOCKER_NAMES.split())
#: What Stadium refuses of Docker's list (the docstring's table says why).
STRICTER = frozenset(
    {
        "ptrace", "process_vm_readv", "process_vm_writev", "modify_ldt",
        "adjtimex", "clock_adjtime", "clock_adjtime64",
    }
)  # fmt: skip
#: The calls a session may make whatever their arguments.
ALLOWED = DOCKER_ALLOWED - STRICTER

#: Calls refused whatever their arguments (the tests check none is allowed): every one
#: the old deny-list named, and those Docker refuses an unprivileged container.
DENIED = (
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "process_madvise",
    # the kernel itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "create_module",
    # mounts
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # namespaces
    "unshare", "setns",
    # keyring, kernel programs, counters, fault handling, handles, file system events
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "open_by_handle_at", "fanotify_init",
    # the machine
    "reboot", "swapon", "swapoff", "syslog", "acct", "sethostname", "setdomainname",
    "vhangup", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "iopl", "ioperm", "modify_ldt",
    "quotactl", "quotactl_fd", "nfsservctl", "lookup_dcookie", "uselib", "ustat", "sysfs",
    "_sysctl",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "migrate_pages", "move_pages", "mbind", "set_mempolicy", "get_mempolicy",
)  # fmt: skip


class _SockFprog(ctypes.Structure):
    """``struct sock_fprog``: a BPF program's length (instructions) and address."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _ArgCmp(ctypes.Structure):
    """``struct scmp_arg_cmp``: argument ``arg`` compared by ``op`` with ``a`` (and ``b``)."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("a", ctypes.c_uint64),
        ("b", ctypes.c_uint64),
    ]


def _libc_free(pointer: int) -> None:
    libc().free(ctypes.c_void_p(pointer))


def _errno_action(code: int) -> int:
    return _ACT_ERRNO | (code & 0xFFFF)


_lib: Any = None


def _library() -> Any:
    """libseccomp, loaded once (``OSError`` when it is not installed)."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or LIBRARY, use_errno=True)
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
        lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p  # malloc'd; freed
        lib.seccomp_arch_native.restype = ctypes.c_uint32
        lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
        lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_ArgCmp),
        ]
        lib.seccomp_export_pfc.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        _lib = lib
    return _lib


def seccomp_unavailable() -> str | None:
    """Why the filter cannot be built here (``None``: it can)."""
    try:
        _library()
    except OSError:
        return (
            f"libseccomp ({LIBRARY}) is not installed: apt-get install libseccomp2 "
            "(make sandbox-deps), or serve with --sandbox-seccomp off to run sandboxed "
            "sessions without a seccomp filter"
        )
    return None


@dataclasses.dataclass(slots=True)
class Filter:
    """A built filter (a libseccomp context), loaded into a process by :meth:`load`.

    Attributes:
        rules: the rules in force (a call refused whatever its arguments counts one,
            a call refused for some arguments counts one per condition).
        skipped: names of calls this kernel's architecture does not have.
    """

    ctx: int
    rules: int
    skipped: tuple[str, ...]
    bpf: bytes = b""
    """The compiled program (``struct sock_filter`` array), what :meth:`load` installs."""

    @property
    def description(self) -> str:
        """What the startup log says of it."""
        return (
            f"{NAME} ({self.rules} rules: Docker's default allow-list for an unprivileged "
            "container, less ptrace, modify_ldt, adjtimex and non-inet sockets; EPERM for "
            "the rest; clone3 and calls newer than libseccomp ENOSYS)"
        )

    def load(self) -> None:
        """Install the filter in the calling process (irreversible; inherited by forks):
        the program compiled in :func:`build_filter`, with ``no_new_privs`` (which the
        kernel requires of an unprivileged process)."""
        c = libc()
        if c.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        program = ctypes.create_string_buffer(self.bpf, len(self.bpf))
        fprog = _SockFprog(len(self.bpf) // 8, ctypes.cast(program, ctypes.c_void_p))
        rc = c.prctl(PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")

    def pfc(self, fd: int) -> None:
        """Write the filter as libseccomp's readable pseudo-code to ``fd`` (debugging)."""
        _library().seccomp_export_pfc(self.ctx, fd)


def build_filter() -> Filter:
    """Build the allow-list filter of the module docstring.

    Raises:
        ConfigError: libseccomp is missing, or refused a rule.
    """
    why = seccomp_unavailable()
    if why is not None:
        raise ConfigError(why)
    lib = _library()
    eperm = _errno_action(errno.EPERM)
    ctx = lib.seccomp_init(eperm)
    if not ctx:
        raise ConfigError("seccomp_init failed (libseccomp could not make a filter)")
    lib.seccomp_attr_set(ctx, _FLTATR_CTL_OPTIMIZE, 2)  # optional: linear otherwise
    rules = 0
    skipped: list[str] = []

    def add(nr: int, name: str, action: int, *conds: tuple[int, int, int, int]) -> None:
        nonlocal rules
        array = (_ArgCmp * len(conds))(*(_ArgCmp(*c) for c in conds)) if conds else None
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(conds), array)
        if rc != 0:
            lib.seccomp_release(ctx)
            raise ConfigError(
                f"libseccomp refused the rule for {name}: {errno.errorcode.get(-rc, rc)}"
            )
        rules += 1

    def number(name: str) -> int:
        nr: int = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a call of this architecture (or newer than libseccomp)
            skipped.append(name)
        return nr

    for name in sorted(ALLOWED):
        if (nr := number(name)) >= 0:
            add(nr, name, _ACT_ALLOW)
    if (nr := number("clone")) >= 0:
        add(nr, "clone", _ACT_ALLOW, (0, _CMP_MASKED_EQ, CLONE_NAMESPACE_MASK, 0))
    if (nr := number("personality")) >= 0:
        for persona in PERSONALITIES:
            add(nr, "personality", _ACT_ALLOW, (0, _CMP_EQ, persona, 0))
    if (nr := number("socket")) >= 0:
        for family in ALLOWED_FAMILIES:
            add(nr, "socket", _ACT_ALLOW, (0, _CMP_EQ, family, 0))
    enosys = _errno_action(errno.ENOSYS)
    if (nr := number("clone3")) >= 0:
        add(nr, "clone3", enosys)
    arch = lib.seccomp_arch_native()
    for nr in range(NEW_CALLS_END):  # numbers libseccomp cannot name: newer calls
        named = lib.seccomp_syscall_resolve_num_arch(arch, nr)
        if named:
            _libc_free(named)
        else:
            add(nr, f"call {nr}", enosys)
    fd = os.memfd_create("stadium-seccomp", os.MFD_CLOEXEC)
    try:
        rc = lib.seccomp_export_bpf(ctx, fd)
        if rc != 0:
            lib.seccomp_release(ctx)
            raise ConfigError(
                f"libseccomp could not compile the filter: {errno.errorcode.get(-rc, rc)}"
            )
        size = os.lseek(fd, 0, os.SEEK_CUR)
        bpf = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    if not bpf or len(bpf) % 8:
        raise ConfigError(f"libseccomp compiled a filter of {len(bpf)} bytes (not BPF)")
    return Filter(ctx, rules, tuple(skipped), bpf)
