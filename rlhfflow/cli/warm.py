"""``rlhfflow warm``: show or stop the warm servers runs start from."""

from __future__ import annotations

import click


@click.command()
@click.option("--stop", is_flag=True, help="Stop every warm server of this user (runs "
                                             "going on are not touched).")
def warm(stop: bool) -> None:
    """Show the warm servers that `rlhfflow run` starts from, or stop them.

    The first `rlhfflow run` starts a warm server: a background process of yours that
    imported torch, transformers and Dask once. Later runs are forks of it and start in
    about 2 s instead of 8-10. It exits after RLHFFLOW_WARM seconds unused (default
    600); RLHFFLOW_WARM=0 turns it off. A new one starts when the installation, an
    import-time environment variable (OMP_*, HF_*, CUDA_*, ...) or the cgroup changes
    (one server per cgroup: a run never joins another job's).

    A forked run never uses more than the command that started it: its coordinator and
    its workers take the command's nice value, CPU affinity (taskset), resource limits
    (ulimit, prlimit) and umask. Where the command may use more than the server (a lower
    nice value, a higher hard limit), the run starts without the server, said in one
    line. Under a batch scheduler (SLURM_JOB_ID, PBS_JOBID, LSB_JOBID set) or in a
    container the server is off unless RLHFFLOW_WARM is set.

    \b
    Example:
      rlhfflow warm
      rlhfflow warm --stop
    """
    import os
    import time

    from rlhfflow.launch import warm as warm_server

    if stop:
        click.echo(f"stopped {warm_server.stop_servers()} warm server(s)")
        return
    found = warm_server.servers()
    confined = warm_server.confined()
    if warm_server.enabled():
        state = f"on, idle exit after {warm_server.idle_seconds():.0f} s"
    elif confined and not os.environ.get(warm_server.ENV_VAR, "").strip():
        state = f"off in {confined}; RLHFFLOW_WARM=600 turns it on"
    else:
        state = "off (RLHFFLOW_WARM=0)"
    click.echo(f"warm server: {state}; {len(found)} running")
    now = time.time()
    for info in found:
        click.echo(f"  pid {info['pid']}: up {now - info['started']:.0f} s, unused "
                   f"{now - info['last_used']:.0f} s, imports took {info['imports_s']} s"
                   + ("" if info["current"] else " (another installation or environment)"))
