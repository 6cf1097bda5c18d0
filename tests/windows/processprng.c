/* bcryptprimitives.dll for wine 8.0, which lacks it (issue 27).
 *
 * Rust's std (>= 1.78) on Windows takes its random bytes (HashMap keys)
 * from bcryptprimitives.dll!ProcessPrng, which Windows 10+ has and wine
 * 8.0 does not: every Rust program fails to start there. This DLL exports
 * ProcessPrng over RtlGenRandom (advapi32!SystemFunction036), which wine
 * has. It is loaded only by the wine test runner (tests/windows/wine-run);
 * nothing ships it. Built with mingw:
 *   x86_64-w64-mingw32-gcc -shared -O2 -o bcryptprimitives.dll processprng.c -ladvapi32
 */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len)
{
    while (len > 0) {
        ULONG chunk = len > 0x10000000 ? 0x10000000 : (ULONG)len;
        if (!SystemFunction036(data, chunk))
            return FALSE;
        data += chunk;
        len -= chunk;
    }
    return TRUE;
}
