#!/bin/sh
# vLLM's NixlConnector pull sequence (nixl_compat_test.py's
# VllmSequence.test_pull: prefill and decode as separate processes) inside
# the Soft-RoCE VM, with the engines held to RDMA (KVFERRY_TRANSPORT=rdma:
# no TCP fallback). CI's softroce stage boots the VM with python3
# (vm.sh --python) and ships libkvferry.so and nixl_vm_tree.tar to /t/.
# One "[       OK ]" line for tools/test_summary.py when it passes.
set -e
mkdir -p /tmp/nixl
tar -C /tmp/nixl -xf /t/nixl_vm_tree.tar
export KVFERRY_LIBRARY=/t/libkvferry.so KVFERRY_TRANSPORT=rdma
exec python3 /tmp/nixl/pyunit_gtest.py --prefix=softroce_nixl --only=VllmSequence.test_pull \
  /tmp/nixl/nixl_compat_test.py
