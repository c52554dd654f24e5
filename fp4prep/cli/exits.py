"""What every fp4prep command's exit status means.

0  done
1  our side: the pipeline or the server failed, the server can't be reached, a job ended ``error``
2  your input: bad arguments or files, a 4xx, a job that ended ``user_error``, a missing extra
3  a watched job was cancelled
130  you stopped the command (Ctrl-C): a local run leaves nothing written; a remote job goes on
"""

OK = 0
ERROR = 1
INPUT = 2
CANCELLED = 3
STOPPED = 130

# A watched job's end, as the command's status.
JOB_EXIT = {"completed": OK, "error": ERROR, "user_error": INPUT, "cancelled": CANCELLED}
