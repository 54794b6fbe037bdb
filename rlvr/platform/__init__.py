"""What rlvr needs from the machine and the process: seeds, devices and precision, torchrun's collectives, the
allocator and freed memory, the fp32 matmul kernel, fault injection for the crash tests."""
