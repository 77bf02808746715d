// cpuid_cap: make a whole process see a smaller x86 CPU, by what CPUID answers.
//
// PAGEDATTN_CPU_ISA caps pagedattn, PyTorch, oneDNN and MKL through their own variables, but a
// peer engine may pick kernels from CPUID itself (OpenVINO's MLAS does). Loaded with LD_PRELOAD,
// this library turns on CPUID faulting for the process (Linux arch_prctl(ARCH_SET_CPUID, 0), on
// CPUs that list `cpuid_fault`): every CPUID then raises SIGSEGV, and the handler answers it
// with the real CPUID minus the features above the level in PAGEDATTN_CPU_ISA (avx512, avx2,
// scalar). The setting is per thread and inherited by threads and forks; execve resets it, and
// the constructor sets it again in the new program because LD_PRELOAD is inherited.
//
// Programs install SIGSEGV handlers of their own (Python's faulthandler, which pytest turns on):
// sigaction() and signal() are wrapped so that such a handler is kept aside and called for every
// fault that is not a CPUID, while this library's handler stays installed.
//
// Built by pagedattn.cpu.cpuid_cap with the system C compiler; no torch.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#ifndef ARCH_SET_CPUID
#define ARCH_SET_CPUID 0x1012
#endif

#define BIT(n) (1u << (n))

// What each level hides. Leaf 7 subleaf 0 (EBX, ECX, EDX), leaf 7 subleaf 1 (EAX, EDX), leaf 1
// (ECX), and the XSAVE components of leaf 0xD subleaf 0 (EAX).
struct Mask {
  uint32_t l1_ecx, l7_ebx, l7_ecx, l7_edx, l71_eax, l71_edx, ld_eax;
};

// Each level hides the groups above it, the lower levels' groups included.
// AMX (tile, bf16, int8, fp16), AVX512-FP16, AVX512-BF16 and the AVX10 line: past the x86-64-v4
// level this project calls avx512 (AVX-512 without bf16 or AMX instructions).
#define PAST_AVX512_L7_EDX (BIT(22) | BIT(23) | BIT(24) | BIT(25))
#define PAST_AVX512_L71_EAX (BIT(5) | BIT(21))
#define PAST_AVX512_L71_EDX BIT(19)
#define PAST_AVX512_LD_EAX (BIT(17) | BIT(18))
// Every AVX-512 subset, AVX-VNNI and its relatives: past an x86-64-v3 CPU such as AMD Zen 3.
#define PAST_AVX2_L7_EBX \
  (BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31))
#define PAST_AVX2_L7_ECX (BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14))
#define PAST_AVX2_L7_EDX (PAST_AVX512_L7_EDX | BIT(2) | BIT(3) | BIT(8))
#define PAST_AVX2_L71_EAX (PAST_AVX512_L71_EAX | BIT(4) | BIT(23))
#define PAST_AVX2_L71_EDX (PAST_AVX512_L71_EDX | BIT(4) | BIT(5) | BIT(10))
#define PAST_AVX2_LD_EAX (PAST_AVX512_LD_EAX | BIT(5) | BIT(6) | BIT(7))

static const struct Mask kAboveAvx512 = {
    .l1_ecx = 0,
    .l7_ebx = 0,
    .l7_ecx = 0,
    .l7_edx = PAST_AVX512_L7_EDX,
    .l71_eax = PAST_AVX512_L71_EAX,
    .l71_edx = PAST_AVX512_L71_EDX,
    .ld_eax = PAST_AVX512_LD_EAX,
};
static const struct Mask kAboveAvx2 = {
    .l1_ecx = 0,
    .l7_ebx = PAST_AVX2_L7_EBX,
    .l7_ecx = PAST_AVX2_L7_ECX,
    .l7_edx = PAST_AVX2_L7_EDX,
    .l71_eax = PAST_AVX2_L71_EAX,
    .l71_edx = PAST_AVX2_L71_EDX,
    .ld_eax = PAST_AVX2_LD_EAX,
};
// And FMA, AVX, F16C (leaf 1), AVX2, VAES, VPCLMULQDQ (leaf 7) and the YMM state: x86-64-v2.
static const struct Mask kAboveScalar = {
    .l1_ecx = BIT(12) | BIT(28) | BIT(29),
    .l7_ebx = PAST_AVX2_L7_EBX | BIT(5),
    .l7_ecx = PAST_AVX2_L7_ECX | BIT(9) | BIT(10),
    .l7_edx = PAST_AVX2_L7_EDX,
    .l71_eax = PAST_AVX2_L71_EAX,
    .l71_edx = PAST_AVX2_L71_EDX,
    .ld_eax = PAST_AVX2_LD_EAX | BIT(2),
};

static const struct Mask* g_mask;
static struct sigaction g_chained;  // the program's own SIGSEGV handler, kept aside
static int (*g_real_sigaction)(int, const struct sigaction*, struct sigaction*);

static long arch_prctl_raw(int code, unsigned long arg) {
  return syscall(SYS_arch_prctl, code, arg);
}

static void real_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t out[4]) {
  __asm__ volatile("cpuid"
                   : "=a"(out[0]), "=b"(out[1]), "=c"(out[2]), "=d"(out[3])
                   : "a"(leaf), "c"(subleaf));
}

static void masked_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t out[4]) {
  // NOTE: CPUID faults in this thread too; it is allowed for the one instruction.
  arch_prctl_raw(ARCH_SET_CPUID, 1);
  real_cpuid(leaf, subleaf, out);
  arch_prctl_raw(ARCH_SET_CPUID, 0);
  if (leaf == 1) {
    out[2] &= ~g_mask->l1_ecx;
  } else if (leaf == 7 && subleaf == 0) {
    out[1] &= ~g_mask->l7_ebx;
    out[2] &= ~g_mask->l7_ecx;
    out[3] &= ~g_mask->l7_edx;
  } else if (leaf == 7 && subleaf == 1) {
    out[0] &= ~g_mask->l71_eax;
    out[3] &= ~g_mask->l71_edx;
  } else if (leaf == 0xD && subleaf == 0) {
    out[0] &= ~g_mask->ld_eax;
  }
}

static void on_segv(int sig, siginfo_t* info, void* context) {
  ucontext_t* uc = (ucontext_t*)context;
  greg_t* regs = uc->uc_mcontext.gregs;
  const unsigned char* ip = (const unsigned char*)regs[REG_RIP];
  if (info->si_code == SI_KERNEL && ip[0] == 0x0F && ip[1] == 0xA2) {
    uint32_t out[4];
    masked_cpuid((uint32_t)regs[REG_RAX], (uint32_t)regs[REG_RCX], out);
    regs[REG_RAX] = out[0];
    regs[REG_RBX] = out[1];
    regs[REG_RCX] = out[2];
    regs[REG_RDX] = out[3];
    regs[REG_RIP] += 2;
    return;
  }
  // Not a CPUID: the program's own handler, else the default action (the fault repeats on
  // return and kills the process as it would have without this library).
  if (g_chained.sa_flags & SA_SIGINFO) {
    if (g_chained.sa_sigaction) {
      g_chained.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_chained.sa_handler != SIG_DFL && g_chained.sa_handler != SIG_IGN) {
    g_chained.sa_handler(sig);
    return;
  }
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  g_real_sigaction(SIGSEGV, &dfl, NULL);
}

int sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  if (!g_real_sigaction) {
    g_real_sigaction = dlsym(RTLD_NEXT, "sigaction");
  }
  if (sig != SIGSEGV || g_mask == NULL) {
    return g_real_sigaction(sig, act, old);
  }
  if (old) {
    *old = g_chained;
  }
  if (act) {
    g_chained = *act;
  }
  return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
  struct sigaction act, old;
  memset(&act, 0, sizeof act);
  act.sa_handler = handler;
  sigemptyset(&act.sa_mask);
  act.sa_flags = SA_RESTART;
  if (sigaction(sig, &act, &old) != 0) {
    return SIG_ERR;
  }
  return old.sa_handler;
}

__attribute__((constructor)) static void cpuid_cap_init(void) {
  g_real_sigaction = dlsym(RTLD_NEXT, "sigaction");
  const char* level = getenv("PAGEDATTN_CPU_ISA");
  if (level == NULL) {
    return;
  }
  const struct Mask* mask = NULL;
  if (strcasecmp(level, "avx512") == 0) {
    mask = &kAboveAvx512;
  } else if (strcasecmp(level, "avx2") == 0) {
    mask = &kAboveAvx2;
  } else if (strcasecmp(level, "scalar") == 0) {
    mask = &kAboveScalar;
  } else {
    return;  // native, or a value pagedattn itself rejects
  }
  struct sigaction act;
  memset(&act, 0, sizeof act);
  act.sa_sigaction = on_segv;
  act.sa_flags = SA_SIGINFO;
  sigemptyset(&act.sa_mask);
  if (g_real_sigaction(SIGSEGV, &act, &g_chained) != 0) {
    return;
  }
  if (arch_prctl_raw(ARCH_SET_CPUID, 0) != 0) {
    g_real_sigaction(SIGSEGV, &g_chained, NULL);  // no CPUID faulting here: leave all as it was
    return;
  }
  g_mask = mask;
}
