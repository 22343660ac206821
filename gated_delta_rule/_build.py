# Rewritten by kernels/build.py with a namespace unique to each build, so two
# builds of this kernel can be loaded in one process.
OP_NAMESPACE = "gated_delta_rule_tpu_dev"
