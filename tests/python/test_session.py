"""The Python package through libmoe.so with numpy arrays: a real
moe-expert-server (shm and gRPC), the cpu backend, outputs against an
independent numpy MoE over the checkpoint moe-make-model wrote, async calls,
assignments, stats and argument errors naming the argument."""
import os
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_test_env as env  # noqa: E402
import moe_expert_service as moe  # noqa: E402


class SessionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model = env.make_model(os.path.join(cls.tmp.name, "tiny"), seed=7)
        cls.tensors = env.load_safetensors(cls.model)
        cls.server = env.ExpertServer(cls.model)

    @classmethod
    def tearDownClass(cls):
        cls.server.close()
        cls.tmp.cleanup()

    def open(self, transport="shm", **extra):
        servers = [f"unix://{self.server.socket}"] if transport == "shm" else [self.server.address]
        opts = dict(model=self.model, servers=servers, device="cpu", policy="static", cache_experts_per_layer=2, copy_mode="never",
                    max_tokens=32, cpu_threads=1)
        if transport == "grpc":
            opts["tls"] = {"insecure": True}
        opts.update(extra)
        return moe.Session(**opts)

    def test_forward_matches_numpy_reference_over_both_transports(self):
        rng = np.random.default_rng(1)
        for transport in ("shm", "grpc"):
            with self.open(transport) as s:
                H, E, k = s.model_info["hidden"], s.model_info["num_experts"], s.model_info["top_k"]
                self.assertEqual(s.device, "cpu")
                self.assertNotEqual(s.model_info["identity"], 0)
                for layer in s.served_layers:
                    x, ids, w = env.random_call(rng, 7, H, k, E)
                    stats = {}
                    y = s.forward_layer(layer, x, ids, w, stats=stats)
                    self.assertEqual(y.dtype, np.float32)
                    self.assertEqual(y.shape, (7, H))
                    xb = moe.from_bf16_bits(moe.to_bf16_bits(x))  # the bf16 inputs the service saw
                    err = env.rel_error(y, env.numpy_moe(self.tensors, layer, xb, ids, w))
                    self.assertLessEqual(err, 1e-2, f"{transport} layer {layer}")
                    self.assertEqual(stats["cpu_pairs"], 7 * k)
                    # The library's own reference agrees with numpy too.
                    ref = moe.reference_forward(self.model, layer, x, ids, w)
                    self.assertLessEqual(env.rel_error(ref, env.numpy_moe(self.tensors, layer, xb, ids, w)), 1e-3)

    def test_a_session_of_another_model_is_refused(self):
        # The server serves the checkpoint of seed 7; a session on seed 8 of the same geometry must not mix them.
        for transport in ("shm", "grpc"):
            with self.assertRaises(moe.MoeError) as e:
                self.open(transport, model="synthetic:tiny:seed=8")
            self.assertIn("model identity", str(e.exception))
            self.assertIn(self.model, str(e.exception))

    def test_raw_bf16_bits_in_and_out(self):
        rng = np.random.default_rng(2)
        with self.open() as s:
            H, E, k = s.model_info["hidden"], s.model_info["num_experts"], s.model_info["top_k"]
            x, ids, w = env.random_call(rng, 4, H, k, E)
            bits = moe.to_bf16_bits(x)
            out = np.zeros((4, H), dtype=np.uint16)
            r = s.forward_layer(s.served_layers[0], bits, ids, w, out=out)
            self.assertIs(r, out)
            ref = env.numpy_moe(self.tensors, s.served_layers[0], moe.from_bf16_bits(bits), ids, w)
            self.assertLessEqual(env.rel_error(moe.from_bf16_bits(out), ref), 1e-2)

    def test_assignment_turns_misses_into_hits_and_stays_exact(self):
        rng = np.random.default_rng(3)
        with self.open() as s:
            H, E, k = s.model_info["hidden"], s.model_info["num_experts"], s.model_info["top_k"]
            layer = s.served_layers[-1]
            x, ids, w = env.random_call(rng, 6, H, k, E)
            s.apply_assignment(layer, [int(ids[0, 0]), int(ids[1, 0])])
            s.flush_copies()
            stats = {}
            y = s.forward_layer(layer, x, ids, w, stats=stats)
            want_hits = int(np.isin(ids, [ids[0, 0], ids[1, 0]]).sum())
            self.assertEqual(stats["hit_pairs"], want_hits)
            self.assertEqual(stats["hit_pairs"] + stats["cpu_pairs"] + stats["copied_pairs"], 6 * k)
            xb = moe.from_bf16_bits(moe.to_bf16_bits(x))
            self.assertLessEqual(env.rel_error(y, env.numpy_moe(self.tensors, layer, xb, ids, w)), 1e-2)
            totals = s.totals()
            self.assertEqual(totals["calls"], 1)
            self.assertEqual(totals["hit_pairs"], want_hits)
            self.assertEqual(totals["cache_copies_started"], 2)
            self.assertIn("cpu", s.describe())

    def test_cache_and_session_facts_under_the_cpp_names(self):
        with self.open() as s:
            E, layer = s.model_info["num_experts"], s.served_layers[0]
            self.assertEqual(s.model_info["moe_layers"], s.served_layers)
            self.assertTrue(s.model_info["model_type"] and s.model_info["weight_dtype"])
            self.assertGreater(s.model_info["expert_bytes"], 0)
            # What the experts compute, under the C++ ModelInfo's names (a SiLU family here).
            self.assertEqual(s.model_info["expert_math"], "silu")
            self.assertEqual(s.model_info["routing"], "softmax_topk")
            self.assertEqual((s.options["max_tokens"], s.options["policy"]), (32, "static"))
            self.assertEqual(s.slots_per_layer(), 2)
            s.apply_assignment(layer, [0, 1], pinned=[1])
            s.flush_copies()
            self.assertEqual(sorted(s.cached_experts(layer)), [0, 1])
            self.assertEqual(s.hit_rate(layer), 0.0)
            with self.assertRaises(moe.InvalidArgumentError):
                s.apply_assignment(layer, [0], pinned=[E + 1])
            with self.assertRaises(moe.MoeError):
                s.set_server_enabled("unix:///no/such.sock", False)
            s.set_server_enabled(f"unix://{self.server.socket}", True)

    def test_async_calls_complete_in_any_order(self):
        rng = np.random.default_rng(4)
        with self.open(contexts=2) as s:
            H, E, k = s.model_info["hidden"], s.model_info["num_experts"], s.model_info["top_k"]
            la, lb = s.served_layers[0], s.served_layers[-1]
            a = env.random_call(rng, 5, H, k, E)
            b = env.random_call(rng, 3, H, k, E)
            pa = s.forward_layer_async(la, *a)
            pb = s.forward_layer_async(lb, *b)
            with self.assertRaises(moe.MoeError) as busy:  # only 2 contexts
                s.forward_layer_async(la, *a)
            self.assertEqual(busy.exception.status, "RESOURCE_EXHAUSTED")
            yb = s.wait(pb)
            ya = s.wait(pa)
            with self.assertRaises(ValueError):
                s.wait(pa)  # once only
            for layer, (x, ids, w), y in ((la, a, ya), (lb, b, yb)):
                xb = moe.from_bf16_bits(moe.to_bf16_bits(x))
                self.assertLessEqual(env.rel_error(y, env.numpy_moe(self.tensors, layer, xb, ids, w)), 1e-2)

    def test_bad_arguments_raise_naming_the_argument(self):
        rng = np.random.default_rng(5)
        with self.open() as s:
            H, E, k = s.model_info["hidden"], s.model_info["num_experts"], s.model_info["top_k"]
            L = s.served_layers[0]
            x, ids, w = env.random_call(rng, 3, H, k, E)
            cases = [
                (TypeError, "hidden", lambda: s.forward_layer(L, x.astype(np.float64), ids, w)),
                (TypeError, "hidden", lambda: s.forward_layer(L, [[0.0] * H], ids, w)),
                (ValueError, "hidden", lambda: s.forward_layer(L, x[:, :H - 1], ids, w)),
                (ValueError, "hidden", lambda: s.forward_layer(L, np.asfortranarray(x), ids, w)),
                (TypeError, "topk_ids", lambda: s.forward_layer(L, x, ids.astype(np.int64), w)),
                (ValueError, "topk_ids", lambda: s.forward_layer(L, x, ids[:2], w)),
                (TypeError, "topk_weights", lambda: s.forward_layer(L, x, ids, w.astype(np.float64))),
                (ValueError, "topk_weights", lambda: s.forward_layer(L, x, ids, w[:, :1])),
                (ValueError, "topk_ids", lambda: s.forward_layer(L, x, np.asfortranarray(ids), w)),
                (TypeError, "out", lambda: s.forward_layer(L, x, ids, w, out=np.zeros((3, H), np.float32))),
                (moe.InvalidArgumentError, "layer", lambda: s.forward_layer(0, x, ids, w)),
                (moe.InvalidArgumentError, "expert_ids", lambda: s.forward_layer(L, x, np.full_like(ids, E + 3), w)),
                (moe.InvalidArgumentError, "expert_weights",
                 lambda: s.forward_layer(L, x, ids, np.full_like(w, np.nan))),
                (moe.InvalidArgumentError, "tokens",
                 lambda: s.forward_layer(L, np.zeros((33, H), np.float32), np.zeros((33, k), np.int32),
                                   np.ones((33, k), np.float32))),
                (moe.InvalidArgumentError, "expert", lambda: s.apply_assignment(L, [E + 1])),
            ]
            for exc, word, fn in cases:
                with self.assertRaises(exc, msg=word) as cm:
                    fn()
                self.assertIn(word, str(cm.exception))
            # Still exact afterwards.
            xb = moe.from_bf16_bits(moe.to_bf16_bits(x))
            self.assertLessEqual(env.rel_error(s.forward_layer(L, x, ids, w),
                                               env.numpy_moe(self.tensors, L, xb, ids, w)), 1e-2)
            self.assertGreaterEqual(s.totals()["failed_calls"], 4)
        with self.assertRaises(moe.InvalidArgumentError) as cm:
            moe.Session(model=self.model, cache_slots=3)
        self.assertIn("cache_slots", str(cm.exception))
        with self.assertRaises(moe.MoeError):
            moe.Session(model=self.model, device="cpu", servers=["unix:///nonexistent/expert.sock"],
                        host_copy=False)
        s = self.open()
        s.close()
        with self.assertRaises(ValueError):
            s.forward_layer(L, x, ids, w)


if __name__ == "__main__":
    unittest.main(verbosity=2)
