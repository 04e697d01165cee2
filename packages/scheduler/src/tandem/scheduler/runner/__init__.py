"""The forward stream's side: the model runner, a step's inputs, the CPU and device step
drivers, the CPU decode trace, CUDA graphs and the busy/idle timeline."""
