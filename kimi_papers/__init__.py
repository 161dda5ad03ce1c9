"""Research workbooks: one literate nbdev notebook per ICML 2026 paper, exported as a tested library

Modules:

- `kimi_papers.evaluation.brain_alignment`: The voxel-wise encoding pipeline (layer features, Lanczos downsampling, FIR delays, ridge with per-voxel CV alphas via himalaya, noise ceiling, per-ROI scores) applied to SmolLM2-135M and its really compressed variants (int8, 4-bit RTN and GPTQ, magnitude and Wanda pruning), on a simulated brain with known ground truth, with recovery, sensitivity and broken-model controls."""

__version__ = "0.1.0"
