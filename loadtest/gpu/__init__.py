"""The GPU tools: every Triton kernel compiled without a GPU (`compile`, its calls in
`compile_variants`); GPU speed predicted on the meta device (`roofline`, its op accountant in
`accountant` and `call_sites`, checked against a CPU step by `roofline_calibrate`); and, on a
GPU machine, the GPU check (`check`: the gpu tests, then the benchmark) and the benchmark of
Canvas itself (`bench`, with `kernel_timing` and `report`)."""
