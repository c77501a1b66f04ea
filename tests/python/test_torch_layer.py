"""MoeLayer and select_experts with torch (CPU tensors here; CUDA tensors and
the current CUDA stream on the GPU host): a real moe-expert-server, the
library's session, outputs against a torch SwiGLU MoE over the checkpoint's
weights. Exits 77 (ctest: skipped) when torch is not installed."""
import math
import os
import sys
import tempfile
import unittest

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed (Python.TorchMoeLayer needs it)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_test_env as env  # noqa: E402
import moe_expert_service as moe  # noqa: E402


def torch_moe(tensors, layer, x, ids, w):
    out = torch.zeros(x.shape, dtype=torch.float64)
    x = x.double()
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            p = f"model.layers.{layer}.mlp.experts.{int(ids[t, j])}."
            W = {n: torch.from_numpy(tensors[p + n + "_proj.weight"]).double() for n in ("gate", "up", "down")}
            h = torch.nn.functional.silu(W["gate"] @ x[t]) * (W["up"] @ x[t])
            out[t] += float(w[t, j]) * (W["down"] @ h)
    return out


class TorchLayerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model = env.make_model(os.path.join(cls.tmp.name, "tiny"), seed=9)
        cls.tensors = env.load_safetensors(cls.model)
        cls.server = env.ExpertServer(cls.model)
        cls.device = "cuda" if torch.cuda.is_available() else "cpu"
        cls.session = moe.Session(model=cls.model, servers=[f"unix://{cls.server.socket}"], device="auto",
                                  cache_experts_per_layer=2, policy="static", max_tokens=8, cpu_threads=1)

    @classmethod
    def tearDownClass(cls):
        cls.session.close()
        cls.server.close()
        cls.tmp.cleanup()

    def test_select_experts_softmax_topk_renormalised(self):
        logits = torch.randn(5, 8)
        ids, w = moe.select_experts(logits, 2, renormalize=True)
        self.assertEqual(ids.dtype, torch.int32)
        self.assertEqual(w.dtype, torch.float32)
        ref_w, ref_ids = torch.topk(torch.softmax(logits, -1), 2)
        self.assertTrue(torch.equal(ids.long(), ref_ids))
        self.assertTrue(torch.allclose(w, ref_w / ref_w.sum(-1, keepdim=True)))
        with self.assertRaises(ValueError):
            moe.select_experts(logits, 9)

    def test_select_experts_topk_softmax(self):
        # GPT-OSS's router (the C++ RoutingMode topk_softmax): the k largest
        # logits, softmax over those k; not the softmax-then-top-k weights.
        logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
        ids, w = moe.select_experts(logits, 2, scoring="topk_softmax")
        self.assertEqual(ids.tolist(), [[3, 0], [4, 3]])
        e = math.exp(-1.0)  # row 0's two largest logits, 3 and 2, differ by 1
        self.assertTrue(torch.allclose(w[0], torch.tensor([1 / (1 + e), e / (1 + e)])))
        self.assertTrue(torch.allclose(w.sum(-1), torch.ones(2)))
        _, sm = moe.select_experts(logits, 2, scoring="softmax", renormalize=False)
        self.assertFalse(torch.allclose(w, sm))
        self.assertEqual(self.session.model_info["routing"], "softmax_topk")
        self.assertEqual(self.session.model_info["expert_math"], "silu")
        with self.assertRaises(ValueError):
            moe.select_experts(logits, 2, scoring="topk")

    def test_layer_matches_reference_with_batching_and_dtypes(self):
        torch.manual_seed(0)
        H = self.session.model_info["hidden"]
        for layer in self.session.served_layers:
            m = moe.MoeLayer(self.session, layer)
            x = torch.randn(2, 9, H, dtype=torch.float32, device=self.device)  # 18 tokens > max_tokens 8: split
            ids, w = moe.select_experts(torch.randn(18, self.session.model_info["num_experts"]), 2)
            y = m(x, ids, w)
            self.assertEqual(y.shape, x.shape)
            self.assertEqual(y.dtype, torch.float32)
            xb = x.reshape(-1, H).to(torch.bfloat16).float().cpu()
            ref = torch_moe(self.tensors, layer, xb, ids, w)
            err = (y.reshape(-1, H).double().cpu() - ref).norm() / ref.norm()
            self.assertLessEqual(float(err), 1e-2)

    def test_session_forward_checks_tensors(self):
        H = self.session.model_info["hidden"]
        L = self.session.served_layers[0]
        x = torch.randn(3, H).to(torch.bfloat16)
        ids = torch.zeros(3, 2, dtype=torch.int32)
        ids[:, 1] = 1
        w = torch.ones(3, 2)
        cases = [
            (TypeError, "hidden", lambda: self.session.forward_layer(L, x.float(), ids, w)),
            (TypeError, "topk_ids", lambda: self.session.forward_layer(L, x, ids.long(), w)),
            (TypeError, "topk_weights", lambda: self.session.forward_layer(L, x, ids, w.half())),
            (ValueError, "hidden", lambda: self.session.forward_layer(L, torch.randn(H, 3).to(torch.bfloat16).t(), ids, w)),
            (ValueError, "topk_weights", lambda: self.session.forward_layer(L, x, ids, w[:2])),
            (TypeError, "topk_ids", lambda: self.session.forward_layer(L, x, ids.numpy(), w)),
        ]
        for exc, word, fn in cases:
            with self.assertRaises(exc, msg=word) as cm:
                fn()
            self.assertIn(word, str(cm.exception))
        with self.assertRaises(ValueError):
            moe.MoeLayer(self.session, 0)  # dense layer

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
    def test_cuda_tensors_on_a_side_stream_are_stream_ordered(self):
        H = self.session.model_info["hidden"]
        L = self.session.served_layers[0]
        m = moe.MoeLayer(self.session, L)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = torch.randn(4, H, device="cuda").to(torch.bfloat16) * 3  # produced on the side stream
            ids, w = moe.select_experts(torch.randn(4, self.session.model_info["num_experts"], device="cuda"), 2)
            y = m(x, ids, w) + 0  # consumed on the side stream
        side.synchronize()
        ref = torch_moe(self.tensors, L, x.float().cpu(), ids.cpu(), w.cpu())
        err = (y.double().cpu() - ref).norm() / ref.norm()
        self.assertLessEqual(float(err), 1e-2)

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
    def test_capturable_layer_in_a_cuda_graph_follows_new_inputs_and_placements(self):
        H, E = self.session.model_info["hidden"], self.session.model_info["num_experts"]
        L = self.session.served_layers[-1]
        m = moe.MoeLayer(self.session, L, capturable=True)
        x = torch.zeros(3, H, device="cuda", dtype=torch.bfloat16)
        logits = torch.zeros(3, E, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(x, *moe.select_experts(logits, 2))  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = m(x, *moe.select_experts(logits, 2))
        for step in range(4):
            if step == 2:
                self.session.apply_assignment(L, [0, 1])
                self.session.flush_copies()
            x.copy_(torch.randn(3, H, device="cuda").to(torch.bfloat16))
            logits.copy_(torch.randn(3, E, device="cuda"))
            graph.replay()
            torch.cuda.synchronize()
            ids, w = moe.select_experts(logits, 2)
            ref = torch_moe(self.tensors, L, x.float().cpu(), ids.cpu(), w.cpu())
            err = (y.double().cpu() - ref).norm() / ref.norm()
            self.assertLessEqual(float(err), 1e-2, f"replay {step}")
        self.session.take_stream_error()


if __name__ == "__main__":
    unittest.main(verbosity=2)
