"""The rank process the agent sees when the first attempt is preloaded (``resilience.proc.zygote``).

Run as ``python -u -S zygote_stub.py ZYGOTE CONFIG``: the standard library only, so that it starts in ~20 ms. On the
first attempt it asks the zygote to fork the rank with this process's stdio, environment and directory, relays
every signal it gets to the rank, and ends as the rank ended. No zygote to answer (it stops listening once it has
served the first attempt's ranks, unless ``supervisor.restarts=preloaded``) execs the ordinary command instead: a
cold start, same pid.

``zygote_stub.py --module MODULE SERVER ARGS...`` does the same for another module a server forks (the pipeline's
pool: ``resilience.proc.pool``), in the place of ``python -m MODULE ARGS...``.
"""

import json
import os
import signal
import socket
import sys

# What a launcher sends a rank: stop (TERM, INT, HUP, QUIT), resume (CONT), and the user signals.
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCONT, signal.SIGUSR1,
           signal.SIGUSR2)
RANK = "resilience.rank"


def cold(module, args):
    flags = ["-u"] if module == RANK else []  # as the ordinary commands start them
    os.execv(sys.executable, [sys.executable, *flags, "-m", module, *args])


def main(server, module, args):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect("\0" + server)
        request = {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ),
                   "stub": os.getpid(), "launcher": os.getppid()}
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        reply = sock.recv(4096)
    except OSError:  # no server listening (a zygote that served the first attempt, or none): start cold
        reply = b""
    if not reply:
        sock.close()
        cold(module, args)
    pid = json.loads(reply)["pid"]

    def relay(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in RELAYED:
        signal.signal(signum, relay)
    reply = sock.recv(4096)
    if not reply:  # the server died before its child (a zygote with its supervisor): the child dies of it
        os._exit(1)
    code = os.waitstatus_to_exitcode(json.loads(reply)["status"])
    if code < 0:  # killed: the agent must see the same signal (process_exit names it)
        if -code != signal.SIGKILL:  # SIGKILL has no handler to reset, and cannot be blocked
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--module":
        main(sys.argv[3], sys.argv[2], sys.argv[4:])
    else:
        main(sys.argv[1], RANK, [sys.argv[2]])
