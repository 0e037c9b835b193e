#!/bin/bash
# Runs the MPI backend's suite (comm_mpi_main, one copy per rank) under mpirun with NP
# processes on this machine; fails when any rank fails (mpirun returns the first non-zero
# exit status) or when the run hangs past TIMEOUT seconds (default 50: a rank that failed
# before a collective leaves its peers waiting in it).
#
#   tests/parallel/comm_mpi_test.sh NP path/to/comm_mpi_main [TIMEOUT]
set -euo pipefail

np=$1
bin=$2
limit=${3:-50}

# Inside Bazel's sandbox: HOME is unset and only TEST_TMPDIR is ours to write (OpenMPI keeps
# its session directory and shared-memory files under TMPDIR).
scratch=${TEST_TMPDIR:-$(mktemp -d)}
export HOME=$scratch
export TMPDIR=$scratch
# Every rank is local: never look for ssh/rsh to start them.
export OMPI_MCA_plm_rsh_agent=
# Shared memory only, no probing of network interfaces.
export OMPI_MCA_btl=self,vader
# vader's single-copy path (CMA, process_vm_readv) needs ptrace rights that sandboxes and
# containers withhold; plain copy-in/copy-out always works.
export OMPI_MCA_btl_vader_single_copy_mechanism=none
# Bazel's sandbox gives each test its own PID namespace, so two tests' mpirun can share a pid
# and hence a job id; with vader's segments in the shared /dev/shm their names then collide
# (a crash or hang when MPI tests run concurrently). Keep them in this test's own directory.
export OMPI_MCA_btl_vader_backing_directory=$scratch
# More ranks than cores: idle OpenMP workers must sleep, not spin.
export OMP_WAIT_POLICY=passive
export OMP_NUM_THREADS=1

timeout --kill-after=5 "$limit" mpirun --oversubscribe --allow-run-as-root -np "$np" "$bin"
