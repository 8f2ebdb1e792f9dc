# TEMPORARY: exactness of forced GEMM variants against float64 (ragged shapes, every transpose); argv[1] = matmul kwargs
import sys, numpy as np
sys.path.insert(0, '.')
from mambactl.ops.linear import matmul, f16_error_bound
from mambactl.runtime.gpu import get_runtime
rt = get_runtime()
rng = np.random.default_rng(1)
kw = eval(sys.argv[1]) if len(sys.argv) > 1 else {}
worst = 0
for (M, K, N, sk) in [(130, 100, 260, 1), (256, 96, 128, 1), (65, 17, 130, 1), (130, 1100, 72, 3)]:
    for ta in (False, True):
        for tb in (False, True):
            a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            A = a.T.astype(np.float64) if ta else a.astype(np.float64)
            B = b.T.astype(np.float64) if tb else b.astype(np.float64)
            got = matmul(rt.from_numpy(a), rt.from_numpy(b), trans_a=ta, trans_b=tb, split_k=sk, kernel=kw.get('kernel','matmul'), **{k:v for k,v in kw.items() if k!='kernel'}).numpy()
            ref = A @ B
            if kw.get('precision') == 'f16':
                bound = f16_error_bound(A, B) * (1 + 1e-5 * sk) + 1e-6 * (sk - 1) * (np.abs(A) @ np.abs(B))
            else:
                bound = 1e-5 * (np.abs(A) @ np.abs(B)) + 1e-30
            r = np.max(np.abs(got - ref) / bound)
            worst = max(worst, r)
            print(M, K, N, ta, tb, f"{r:.3g}", "OK" if np.all(np.isfinite(got)) and r <= 1 else "FAIL")
print("worst", worst)
