#!/usr/bin/env python3
# CPU of starting `true` directly and through agentscope-sentinel (children's CPU per spawn, and
# this process's own), as root:  scripts/sentinel-cost.py SENTINEL 300
# SENTINEL: the one svc-host carries, as its build wrote it
# ($CARGO_TARGET_DIR/release/build/svc-host-*/out/agentscope-sentinel) or as a host published it
# (<state>/bin/agentscope-sentinel).
import os, resource, sys, time
S=sys.argv[1]; N=int(sys.argv[2])
def cost(argv):
    r0=resource.getrusage(resource.RUSAGE_CHILDREN); t0=time.process_time()
    for i in range(N):
        pid=os.posix_spawn(argv[0], argv, {"PATH":"/usr/bin:/bin"})
        os.waitpid(pid,0)
    r1=resource.getrusage(resource.RUSAGE_CHILDREN); t1=time.process_time()
    ch=(r1.ru_utime-r0.ru_utime+r1.ru_stime-r0.ru_stime)/N*1000
    me=(t1-t0)/N*1000
    return round(ch,3), round(me,3)
me=str(os.getpid())
print("true direct        (children ms, self ms):", cost(["/bin/true"]))
print("sentinel -> true   (children ms, self ms):", cost([S, me, "-", "--", "/bin/true", "true"]))
print("sentinel uid->true (children ms, self ms):", cost([S, me, "1900009990:1900009990", "--", "/bin/true", "true"]))
