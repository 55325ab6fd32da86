"""CUDA graphs for decode-only steps: one graph per batch size of a ladder up to max_num_seqs;
a step replays the smallest graph that holds it, padded with empty sequences. The attention
backend owns the static metadata buffers (init_capture / prepare_for_capture / prepare_for_replay).
Logits stay outside the graph: only the sampling rows need them."""
import torch

from asynct.engine.context import reset_context, set_context


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class CudaGraphRunner:
    def __init__(self, runner, max_num_seqs: int):
        self.backend, self.model = runner.backend, runner.model   # not the runner: no cycle
        self.sizes = batch_size_ladder(max_num_seqs)
        self.max_bs = self.sizes[-1]
        dev = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(self.max_bs, runner.config.hidden_size, dtype=runner.dtype, device=dev)
        max_blocks = (runner.max_model_len + runner.block_size - 1) // runner.block_size
        runner.backend.init_capture(self.max_bs, max_blocks, runner.max_model_len, dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture()

    @torch.inference_mode()
    def capture(self):
        pool = None
        backend, model = self.backend, self.model
        for bs in reversed(self.sizes):
            set_context(backend.prepare_for_capture(bs))
            self.hidden[:bs] = model(self.input_ids[:bs], self.positions[:bs])   # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:bs] = model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = graph
            reset_context()
        torch.cuda.synchronize()

    def can_run(self, metadata) -> bool:
        return metadata.num_prefills == 0 and 0 < metadata.num_decodes <= self.max_bs

    def run(self, input_ids, positions, metadata):
        n = metadata.num_decodes
        bs = next(b for b in self.sizes if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.positions[n:bs].zero_()
        self.backend.prepare_for_replay(metadata, bs)
        self.graphs[bs].replay()
        return self.hidden[:n]
